"""Rolling upgrades: sidecars and engine clients of other releases, run for real.

Each old release is ``git archive`` of a fixed revision unpacked into a temp
directory as package ``kvsidecar`` and put on ``PYTHONPATH`` of the processes
that play it: its sidecar (``SidecarProcess`` with that environment) and its
engine (a small script using that release's own ``SimEngine``). The supported
skew (docs/operations.md, "Rolling upgrades") moves the oracle's bytes; the
refused one fails with an error that names the version skew.

Skipped where there is no git history to archive (an sdist, a wheel install).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvsidecar
from kvsidecar.ipc.client import SidecarClient
from kvsidecar.ipc.memory import RegionError
from kvsidecar.ipc.protocol import RemoteEngine
from kvsidecar.sim.cluster import Sent, SidecarProcess, SimEngine
from kvsidecar.sim.models import attn
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e

ROOT = Path(kvsidecar.__file__).resolve().parent
#: protocol minor 11, hold tokens and member keys: the oldest release a current
#: sidecar or client works with
FIRST_TOKENS = "0799a3e"
#: protocol minor 10, before hold tokens and before sealed memfds
BEFORE_TOKENS = "9df6509"

#: One engine of the release on PYTHONPATH (argv: role, sockets, json path).
#: p: prefill and hold 3 requests, write them, wait for a line, then for their
#: ``sent``; d: read them, wait, check every byte with the oracle. Prints JSON.
ENGINE = r'''
import json, sys
from kvsidecar.ipc.protocol import RemoteEngine
from kvsidecar.sim import cluster
from kvsidecar.sim.models import attn
from kvsidecar.sim.oracle import Request
role, socks, path = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
eng = cluster.SimEngine(role.upper() + "-eng", attn(8), len(socks), 200, socks, memory="memfd")
if role == "p":
    sents = [eng.prefill(f"r{i}", Request(40 + i, n)) for i, n in enumerate((5, 77, 200))]
    json.dump([[s.request_id, s.remote.engine_id, s.remote.tp_size, s.remote.handshake,
                s.block_ids, s.req.seed, s.req.prompt_tokens, s.tokens] for s in sents],
              open(path, "w"))
    print("HELD", flush=True)
    sys.stdin.readline()
    got = eng.wait_for([s.request_id for s in sents], timeout_s=30)
    out = {r: sorted({c.kind for c in v.values()}) for r, v in got.items()}
else:
    for rid, eid, tp, hs, ids, seed, n, tokens in json.load(open(path)):
        eng.start_read(cluster.Sent(rid, RemoteEngine(eid, tp, hs), ids, Request(seed, n),
                                    tokens))
    got = eng.wait_for([f"r{i}" for i in range(3)], timeout_s=30)
    out = {r: [sorted({c.kind for c in v.values()}), eng.verify(r)[:2]] for r, v in got.items()}
eng.close()
print("RESULT " + json.dumps(out), flush=True)
'''


def _archive(rev: str, into: Path) -> Path:
    """``rev``'s tree as package ``kvsidecar`` under ``into`` (its PYTHONPATH entry)."""
    dest = into / rev / "kvsidecar"
    dest.mkdir(parents=True)
    try:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True, timeout=120).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"no git history to archive {rev} from: {e}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    return into / rev


@pytest.fixture(scope="module")
def old(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    into = tmp_path_factory.mktemp("releases")
    yield {rev: str(_archive(rev, into)) for rev in (FIRST_TOKENS, BEFORE_TOKENS)}


def _sidecars(tmp: Path, name: str, n: int, pythonpath: str | None) -> list[SidecarProcess]:
    env = {"PYTHONPATH": pythonpath} if pythonpath else None
    return [SidecarProcess(tmp, f"{name}{i}", env=env).start() for i in range(n)]


def _engine(role: str, socks: list[SidecarProcess], path: Path, pythonpath: str
            ) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", ENGINE, role,
                             ",".join(s.socket for s in socks), str(path)],
                            env={**os.environ, "PYTHONPATH": pythonpath}, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _result(proc: subprocess.Popen[str], line: str = "") -> dict[str, object]:
    out, _ = proc.communicate(line, timeout=120)
    assert proc.returncode == 0, out
    got: dict[str, object] = json.loads(out.rsplit("RESULT ", 1)[1])
    return got


def test_old_p_serves_new_d_hetero(old: dict[str, str], tmp_path: Path) -> None:
    """A P pod of the first hold-token release (sidecar and engine) serves a D pod
    of this code, tp 1 -> 2: every byte the oracle's."""
    p = _sidecars(tmp_path, "p", 1, old[FIRST_TOKENS])
    d = _sidecars(tmp_path, "d", 2, None)
    sents = tmp_path / "sents.json"
    pe = _engine("p", p, sents, old[FIRST_TOKENS])
    D = None
    try:
        assert pe.stdout is not None and pe.stdout.readline().strip() == "HELD"
        D = SimEngine("D-eng", attn(8), 2, 200, d)
        for rid, eid, tp, hs, ids, seed, n, tokens in json.loads(sents.read_text()):
            D.start_read(Sent(rid, RemoteEngine(eid, tp, hs), ids, Request(seed, n), tokens))
        got = D.wait_for([f"r{i}" for i in range(3)], timeout_s=30)
        for rid, by_rank in got.items():
            assert {c.kind for c in by_rank.values()} == {"received"}, by_rank
            assert D.verify(rid) == []
        assert _result(pe, "go\n") == {f"r{i}": ["sent"] for i in range(3)}
    finally:
        if pe.poll() is None:
            pe.kill()
        if D is not None:
            D.close()
        assert [s.stop() for s in p + d] == [0, 0, 0]


def test_new_p_serves_old_d(old: dict[str, str], tmp_path: Path) -> None:
    """The reverse: a P pod of this code, a D pod of the first hold-token release."""
    p = _sidecars(tmp_path, "p", 1, None)
    d = _sidecars(tmp_path, "d", 1, old[FIRST_TOKENS])
    P = SimEngine("P-eng", attn(8), 1, 200, p)
    try:
        sents = [P.prefill(f"r{i}", Request(40 + i, n)) for i, n in enumerate((5, 77, 200))]
        path = tmp_path / "sents.json"
        path.write_text(json.dumps([[s.request_id, s.remote.engine_id, s.remote.tp_size,
                                     s.remote.handshake, s.block_ids, s.req.seed,
                                     s.req.prompt_tokens, s.tokens] for s in sents]))
        got = _result(_engine("d", d, path, old[FIRST_TOKENS]))
        assert got == {f"r{i}": [["received"], []] for i in range(3)}
        done = P.wait_for([s.request_id for s in sents], timeout_s=30)
        assert all({c.kind for c in v.values()} == {"sent"} for v in done.values()), done
    finally:
        P.close()
        assert [s.stop() for s in p + d] == [0, 0]


OLD_CLIENT = r'''
from kvsidecar.ipc.client import SidecarClient
from kvsidecar.ipc.protocol import RemoteEngine
from kvsidecar.sim.models import attn
import sys
c = SidecarClient(sys.argv[1])
try:
    c.register("old-d", 0, attn(8)(1, 16), allocate=True)  # this release's default: shm
except Exception as e:
    print("REGISTER", e)
c.register("old-d", 0, attn(8)(1, 16), allocate=True, memory="memfd")
try:
    c.read("old-d", "r", [[0]], RemoteEngine("p", 1, ["127.0.0.1:1"]), [[0]])
except Exception as e:
    print("READ", e)
'''


def test_client_before_tokens_is_refused_naming_the_skew(old: dict[str, str],
                                                         tmp_path: Path) -> None:
    """An engine client of protocol minor 10 on this sidecar: its default memory
    kind and its token-less reads are refused, each naming the version skew."""
    (d,) = _sidecars(tmp_path, "d", 1, None)
    try:
        out = subprocess.run([sys.executable, "-c", OLD_CLIENT, d.socket], text=True,
                             capture_output=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": old[BEFORE_TOKENS]})
        assert out.returncode == 0, out.stderr
        lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
        assert "cannot be sealed" in lines["REGISTER"]
        assert "carries 0 hold tokens" in lines["READ"]
        assert "minor 10 or older" in lines["REGISTER"]
        assert "before protocol minor 11" in lines["READ"]
        assert all("version skew is refused" in line for line in lines.values()), lines
    finally:
        assert d.stop() == 0


def test_new_client_on_sidecar_before_sealed_memfds(old: dict[str, str],
                                                    tmp_path: Path) -> None:
    """This client on a sidecar of protocol minor 10 from before sealed memfds:
    registration is refused (nothing mapped, nothing left registered), naming the
    skew; the sidecar lives on."""
    (d,) = _sidecars(tmp_path, "d", 1, old[BEFORE_TOKENS])
    try:
        with SidecarClient(d.socket) as c:
            with pytest.raises(RegionError, match=r"not sealed.*older than this client"):
                c.register("new-d", 0, attn(8)(1, 16), allocate=True)
            assert c.ping(["new-d"]).engines == []
        assert d.alive()
    finally:
        assert d.stop() == 0
