"""Attacks on a real sidecar by another local user.

The daemon runs as root (as CI does) and lets the group ``nogroup`` use its
engine socket, the multi-tenant set-up; the attacker is a separate process
running as ``nobody:nogroup``. It must not see, use, replace or deregister
the victim's engine, nor get the sidecar to map memory it does not own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvsidecar.ipc.client import BadRequest, SidecarClient, SidecarError
from kvsidecar.ipc.memory import ENGINE_SHM_PREFIX, ShmRegion, unique_name
from kvsidecar.ipc.protocol import Register, RemoteEngine, ShmRef, decode_reply, encode_request
from kvsidecar.ipc.seqpacket import BlockingChannel
from kvsidecar.sim.cluster import SidecarProcess, fleet_keys
from kvsidecar.sim.models import attn

# Each test starts its own sidecars: minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

NOBODY = 65534

def _attack(sock_path: str, victim: str, root_region: str, unprefixed: str) -> dict[str, Any]:
    """What a process of another user tries (run in a forked child as nobody)."""
    layout = attn(2)(1, 16)
    out: dict[str, Any] = {}
    c = SidecarClient(sock_path, timeout_s=20)

    def attempt(name: str, fn: Callable[[], object]) -> None:
        try:
            fn()
            out[name] = "accepted"
        except SidecarError as e:
            out[name] = f"{type(e).__name__}: {e.message}"

    out["ping_engines"] = c.ping().engines
    out["status_engines"] = [e.engine_id for e in c.status().engines]
    attempt("poll", lambda: c.poll(victim))
    attempt("hold", lambda: c.hold(victim, "x", [[0]]))
    attempt("deregister", lambda: c.deregister(victim))
    attempt("register_same_id", lambda: c.register(victim, 0, layout, allocate=True))
    with BlockingChannel(sock_path, timeout_s=20) as d:
        for i, name in enumerate([root_region, unprefixed]):
            req = Register(id=100 + i, engine_id=f"thief{i}", tp_rank=0, layout=layout,
                           mode="attach",
                           regions=[ShmRef(name, layout.region_bytes)] * layout.num_regions)
            d.send(encode_request(req))
            r = decode_reply(d.recv())
            out[f"attach_{i}"] = f"{type(r).__name__}: {getattr(r, 'message', '')}"
    return out


def _as_nobody(fn: Callable[..., dict[str, Any]], *args: str) -> dict[str, Any]:
    """Run ``fn`` in a forked child that became nobody:nogroup (no exec: the
    interpreter may live where nobody cannot read it, e.g. under /root)."""
    return _as_user(NOBODY, NOBODY, [], fn, *args)


def _as_user(uid: int, gid: int, groups: list[int], fn: Callable[..., dict[str, Any]],
             *args: str) -> dict[str, Any]:
    """Run ``fn`` in a forked child that became ``uid:gid`` with supplementary
    ``groups``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            os.write(w, json.dumps(fn(*args)).encode())
            code = 0
        except BaseException as e:
            os.write(w, json.dumps({"error": repr(e)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    out: dict[str, Any] = json.loads(data)
    assert os.waitstatus_to_exitcode(status) == 0, out
    return out


@contextlib.contextmanager
def _sidecar_for_others(prefix: str, name: str, args: list[str]) -> Iterator[SidecarProcess]:
    """A sidecar whose socket other users may reach: its work folder under /tmp
    is traversable (pytest's own tmp dirs are 0700), its socket in a directory
    the sidecar creates."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(workdir, 0o755)
    side = SidecarProcess(workdir, name, args=args)
    side.socket = str(workdir / "run" / f"{name}.sock")
    try:
        side.start()
        yield side
    finally:
        side.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def shared_sidecar() -> Iterator[SidecarProcess]:
    if os.geteuid() != 0:
        pytest.skip("needs root: the attacker runs as another user (nobody)")
    with _sidecar_for_others("kvs-sec-", "shared",
                             ["--allow-gid", str(NOBODY), "--allow-unsealed-shm"]) as side:
        yield side


def test_another_user_cannot_see_use_or_steal_an_engine(shared_sidecar: SidecarProcess) -> None:
    layout = attn(2)(1, 16)
    owner = SidecarClient(shared_sidecar.socket, timeout_s=30)
    owner.register("victim", 0, layout, allocate=True)
    # A region of the right name and size that root (not the attacker) owns.
    root_region = ShmRegion.create(unique_name(ENGINE_SHM_PREFIX + "root"), layout.region_bytes)
    try:
        got = _as_nobody(_attack, shared_sidecar.socket, "victim", root_region.name,
                         "not-prefixed-region")
    finally:
        root_region.close()
        root_region.unlink()
    assert got["ping_engines"] == []  # the victim's engine is not even listed
    assert got["status_engines"] == []  # nor by kvsidecar status
    for op in ("poll", "hold", "deregister"):
        assert got[op] == "UnknownEngine: engine 'victim' is not registered here", got[op]
    assert got["register_same_id"].startswith("Duplicate: engine id 'victim' is taken")
    assert got["attach_0"].startswith("Error: ") and "belongs to uid 0" in got["attach_0"]
    assert f"named {ENGINE_SHM_PREFIX}" in got["attach_1"]
    # The victim is untouched and still served.
    assert owner.poll("victim") == []
    assert owner.ping().engines == ["victim"]
    owner.deregister("victim")
    owner.close()


def test_socket_mode_and_group_for_a_shared_sidecar(shared_sidecar: SidecarProcess) -> None:
    st = os.stat(shared_sidecar.socket)
    assert (st.st_mode & 0o777, st.st_gid) == (0o660, NOBODY)
    st = os.stat(Path(shared_sidecar.socket).parent)
    assert (st.st_mode & 0o777, st.st_gid) == (0o750, NOBODY)


def test_a_sidecar_without_peer_keys_exits_2_with_one_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "serve", "--socket", str(tmp_path / "x.sock")],
        capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items()
             if k not in ("KVSIDECAR_PEER_KEYS", "CREDENTIALS_DIRECTORY")},
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("kvsidecar: no "), run.stderr
    assert "kvsidecar keys" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "x.sock").exists()


def test_a_second_sidecar_on_a_live_socket_exits_2_and_leaves_it(tmp_path: Path) -> None:
    first = SidecarProcess(tmp_path, "one").start()
    try:
        second = subprocess.run(
            [sys.executable, "-m", "kvsidecar", "serve", "--socket", first.socket,
             "--peer-keys", fleet_keys()],
            capture_output=True, text=True, timeout=120,
        )
        assert second.returncode == 2
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith("kvsidecar: another sidecar is serving"), second.stderr
        assert "Traceback" not in second.stderr
        assert Path(first.socket).exists()
        with SidecarClient(first.socket, timeout_s=30) as c:
            assert c.ping().version == 1
    finally:
        assert first.stop() == 0


DAEMON = 1  # uid and gid "daemon": neither the sidecar's nor allowed


def _knock(sock_path: str) -> dict[str, Any]:
    """Connect as a user the file mode lets in (a supplementary group) but whose
    kernel credentials (uid, primary gid) the policy does not name."""
    out: dict[str, Any] = {}
    with BlockingChannel(sock_path, timeout_s=20) as chan:
        out["reply"] = msgspec.msgpack.decode(chan.recv())  # sent before anything is read
        try:
            chan.recv()
        except EOFError:
            out["closed"] = True
    for what, ask in (("client", SidecarClient.ping), ("status", SidecarClient.status)):
        try:
            ask(SidecarClient(sock_path, timeout_s=20))
            out[what] = "accepted"
        except SidecarError as e:
            out[what] = f"{type(e).__name__}: {e.message}"
    return out


def test_past_the_file_mode_but_outside_the_policy_is_forbidden(
        shared_sidecar: SidecarProcess) -> None:
    """The socket is 0660 with group nogroup; a process of uid/gid daemon with
    nogroup as a supplementary group passes the file mode, and SO_PEERCRED (uid
    and primary gid only) stops it: one ``forbidden`` reply, then the end; the
    sync client raises Forbidden. The owner's engine is served throughout."""
    owner = SidecarClient(shared_sidecar.socket, timeout_s=30)
    owner.register("owned", 0, attn(2)(1, 16), allocate=True)
    got = _as_user(DAEMON, DAEMON, [NOBODY], _knock, shared_sidecar.socket)
    assert got["reply"]["code"] == "forbidden", got
    assert f"uid {DAEMON} gid {DAEMON} pid" in got["reply"]["message"], got
    assert got["closed"] is True
    assert got["client"].startswith(f"Forbidden: uid {DAEMON} gid {DAEMON} pid"), got
    assert got["status"].startswith(f"Forbidden: uid {DAEMON} gid {DAEMON} pid"), got
    assert owner.poll("owned") == [] and owner.ping().engines == ["owned"]
    owner.deregister("owned")
    owner.close()


@pytest.fixture(scope="module")
def uid_sidecar() -> Iterator[SidecarProcess]:
    """A sidecar that allows the user nobody by uid alone (no --allow-gid)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the engine runs as another user (nobody)")
    with _sidecar_for_others("kvs-uid-", "byuid",
                             ["--allow-uid", str(NOBODY), "--allow-unsealed-shm"]) as side:
        yield side


def _use(sock_path: str, memory: str) -> dict[str, Any]:
    """Ping, register with ``memory`` allocated by the sidecar, write into it, go."""
    out: dict[str, Any] = {}
    try:
        with SidecarClient(sock_path, timeout_s=30) as c:
            out["version"] = c.ping().version
            reg = c.register(f"by-uid-{memory}", 0, attn(2)(1, 8), allocate=True,
                             memory=memory)  # type: ignore[arg-type]
            reg.regions[0].numpy()[:3] = 9
            out["kinds"] = sorted({type(r).__name__ for r in reg.regions})
            for r in reg.regions:
                r.close()
            c.deregister(f"by-uid-{memory}")
    except (OSError, SidecarError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.parametrize(("memory", "kind"), [("memfd", "MemfdRegion"), ("shm", "ShmRegion")])
def test_allow_uid_alone_lets_that_user_register(uid_sidecar: SidecarProcess, memory: str,
                                                 kind: str) -> None:
    """--allow-uid without --allow-gid: the allowed user passes the socket's file
    modes (a POSIX ACL entry) and can map what the sidecar allocates for it,
    memfd (passed as an fd) and shm (given to its uid). Before: EACCES on the
    socket (0660, group root), and allocate-mode shm could not be opened."""
    got = _as_nobody(_use, uid_sidecar.socket, memory)
    assert got == {"version": 1, "kinds": [kind]}, got


def test_allow_uid_lets_no_other_user_in(uid_sidecar: SidecarProcess) -> None:
    got = _as_user(DAEMON, DAEMON, [], _use, uid_sidecar.socket, "memfd")
    # The file modes stop it before the credential check: EACCES at connect.
    assert got["error"].startswith("Forbidden: forbidden: cannot connect"), got
    assert "[Errno 13] Permission denied" in got["error"], got


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_a_read_from_the_engine_itself_is_refused_at_once(tmp_path: Path) -> None:
    """Before: accepted, the engine's own agent loaded into itself as a peer (+128 MB
    of RSS), and the read failed later naming something else."""
    side = SidecarProcess(tmp_path, "self").start()
    try:
        assert side.proc is not None
        with SidecarClient(side.socket, timeout_s=30) as c:
            layout = attn(2)(1, 16)
            reg = c.register("narcissus", 0, layout, allocate=True)
            before = _rss(side.proc.pid)
            me = RemoteEngine("narcissus", 1, [reg.handshake_address])
            for i in range(3):
                with pytest.raises(BadRequest, match="asked to read from itself"):
                    c.read("narcissus", f"self-{i}", [[1]], me, [[0]])
            time.sleep(2)
            assert c.poll("narcissus") == []  # nothing was accepted
            assert _rss(side.proc.pid) - before < 16 << 20
            for r in reg.regions:
                r.close()
            c.deregister("narcissus")
    finally:
        assert side.stop() == 0
