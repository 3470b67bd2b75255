"""An engine's empty poll while its D sidecar is busy (issue #31, by hand):
``poll`` (a round trip, answered when D's loop gets to it) against
``poll_nowait`` (the sidecar pushes completions to a poll parked there; an
empty call reads the socket only), same run, alternating in rounds of 20.

The poller is a process of its own with an engine of its own on D, each call
after a 1 ms sleep (an engine step between); it runs once with D idle and
once while this process keeps D busy with another engine's rounds of 64
``read_nowait`` reads (P holding with ``hold_nowait``). Prints wall time and
the poller's CPU per call, p50 / p99.

    .venv/bin/python benchmarks/busy_poll.py [seconds]
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite import Fleet, Pair, small_attention, wait_all

POLLER = r'''
import json, sys, time
from kvsidecar.ipc.client import SidecarClient
from kvsidecar.sim.models import attn
sock, secs = sys.argv[1], float(sys.argv[2])
c = SidecarClient(sock, timeout_s=30)
c.register("busy-E", 0, attn(1)(1, 8), allocate=True)
res = {"poll": [], "poll_nowait": [], "poll cpu": [], "poll_nowait cpu": []}
end = time.monotonic() + secs
while time.monotonic() < end:
    for name, f in (("poll", c.poll), ("poll_nowait", c.poll_nowait)):
        for _ in range(20):
            c0, t0 = time.thread_time(), time.perf_counter()
            assert f("busy-E") == []
            res[name].append(time.perf_counter() - t0)
            res[name + " cpu"].append(time.thread_time() - c0)
            time.sleep(0.001)
c.deregister("busy-E")
c.close()
def q(v, p):
    return sorted(v)[int(p / 100 * (len(v) - 1))] * 1e6
print(json.dumps({k: f"{q(v, 50):.0f} / {q(v, 99):.0f} us" for k, v in res.items()}))
'''


def main() -> None:
    secs = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
    k, window = 16, 64
    with Fleet() as fleet:
        p0, d0 = fleet(["p0", "d0"])
        pair = Pair(p0, d0, small_attention, k * window, "busy")
        warm = pair.prefill(8 * k)
        pair.D.start_read(warm)
        pair.finish([warm], wait_all(pair.D, [warm.request_id]))
        for busy in (False, True):
            poller = subprocess.Popen([sys.executable, "-c", POLLER, d0.socket, str(secs)],
                                      stdout=subprocess.PIPE, text=True)
            done = 0
            end = time.time() + secs + 1
            while busy and time.time() < end:
                sents = [pair.prefill(8 * k, hold=False) for _ in range(window)]
                pair.P.hold_nowait(sents)
                pair.D.start_reads_nowait(sents)
                pair.finish(sents, wait_all(pair.D, [x.request_id for x in sents]),
                            verify=False)
                done += window
            out = poller.communicate()[0].strip()
            print(f"D {'busy' if busy else 'idle'} ({done} reads): {out}")
        pair.close()


if __name__ == "__main__":
    main()
