"""The Linux CPU scheduling policy of the sidecar's threads (``--cpu-policy``).

``batch`` (the default) puts every thread of the process under ``SCHED_BATCH``:
a sidecar thread woken by a message (the event loop by an engine's request or
a peer's grant, ZMQ's I/O thread by the loop's send, a NIXL worker by a post)
then never preempts the thread running on that core; it runs on an idle core
at once, or when that thread's slice ends or it waits. On a host where the
sidecar shares cores with its engine, the engine is not interrupted by the
sidecar's wake-ups, and the sidecar's own threads stop preempting each other
(a send that wakes ZMQ's I/O thread no longer costs the loop its core), so
fewer context switches per read. Measured on the 2-core CPU host (same-run
A/B, every thread of both sidecars switched at run time, rounds of 64 reads
alternating, two runs): one ``read`` per message +16 and +21 % reads/s,
``read_nowait`` +14 %, 16 per ``read_many`` +6 and +6 %; sidecar CPU per
read -8 to -18 %; 1-block latency p50 687 → 687 µs, and 1,063 → 965 µs with
a busy process on one core; its p99 moved both ways between runs (1,247 →
1,045 µs; 2,804 → 3,516 µs with the busy core: docs/performance.md).
``normal`` leaves the kernel's default (``SCHED_OTHER``). Neither needs a
privilege.

Threads inherit the policy of the thread that starts them, so it is set once
at start-up on every thread then alive (imports may have started some) and
every later thread (the loop's executors, NIXL workers, UCX's and libzmq's
threads) starts under it.
"""

from __future__ import annotations

import os

__all__ = ["POLICIES", "apply"]

#: ``--cpu-policy`` values, the default first
POLICIES = ("batch", "normal")


def _policy(name: str) -> int:
    if name == "batch":
        return os.SCHED_BATCH
    if name == "normal":
        return os.SCHED_OTHER
    raise ValueError(f"unknown CPU policy {name!r} (one of {', '.join(POLICIES)})")


def apply(name: str) -> str | None:
    """Give every thread of this process the policy ``name`` (one of
    :data:`POLICIES`); None once every thread has it, else what failed (a
    sandbox that forbids ``sched_setscheduler``: those threads run on under
    the kernel's default). The threads are listed again until a pass finds
    none new: a thread one of them started meanwhile (under the old policy)
    is not missed."""
    policy = _policy(name)
    param = os.sched_param(0)
    done: set[int] = set()
    failed: list[str] = []
    for _ in range(_MAX_PASSES):
        try:
            tids = {int(t) for t in os.listdir("/proc/self/task")} - done
        except OSError as e:  # no /proc: this thread (and every thread it starts)
            tids, failed = ({0} - done), [*failed, f"/proc/self/task: {e}"]
        if not tids:
            break
        for tid in tids:
            done.add(tid)
            try:
                os.sched_setscheduler(tid, policy, param)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
            except OSError as e:
                failed.append(f"thread {tid}: {e}")
    if failed:
        return (f"sched_setscheduler({name}) failed for {len(failed)} of {len(done)} "
                f"thread(s): {failed[0]}")
    return None


#: listing passes at most (a start-up with threads that keep starting threads)
_MAX_PASSES = 8
