"""fd passing (SCM_RIGHTS) between the sidecar's fd socket and an engine: real
Unix sockets, real memfds, real mappings; no sidecar process (see
tests/e2e/test_memfd.py for transfers through real sidecars)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsidecar.daemon.engine_access import AccessPolicy
from kvsidecar.daemon.fd_server import FdServer
from kvsidecar.ipc.fdpass import (
    FdPassError,
    batches,
    encode_error,
    encode_header,
    encode_request,
    fetch_fds,
    parse_reply,
    parse_request,
)
from kvsidecar.ipc.mapping import map_refs
from kvsidecar.ipc.memfd import MemfdRegion
from kvsidecar.ipc.memory import RegionError
from kvsidecar.ipc.protocol import MemfdRef

from .as_user import NOBODY, run_as
from .loop_turns import LoopTurns, connect_all, until

TOKEN = "ab" * 16


def test_messages_round_trip() -> None:
    assert parse_request(encode_request(TOKEN)) == TOKEN
    assert parse_reply(encode_header(250, 600)) == (250, 600)
    assert batches(600) == [(0, 250), (250, 250), (500, 100)]
    assert batches(3) == [(0, 3)]


@pytest.mark.parametrize("data", [b"", b"KVSFD/1 ", b"KVSFD/1 XYZ" + b"0" * 20,
                                  b"KVSFD/2 " + TOKEN.encode(), b"KVSFD/1 " + b"a" * 200])
def test_malformed_requests_are_refused(data: bytes) -> None:
    with pytest.raises(FdPassError):
        parse_request(data)


def test_error_reply_carries_the_reason() -> None:
    with pytest.raises(FdPassError, match="refused to pass file descriptors: go away"):
        parse_reply(encode_error("go away"))
    with pytest.raises(FdPassError, match="unexpected reply"):
        parse_reply(b"junk")


async def _serving(tmp_path: Path, access: AccessPolicy,
                   body: Callable[[FdServer], Any]) -> Any:
    server = FdServer(str(tmp_path / "e.sock.fds"), access, timeout_s=5)
    await server.start()
    try:
        return await asyncio.get_running_loop().run_in_executor(None, body, server)
    finally:
        await server.stop()


async def test_memfd_pages_are_shared_zero_copy(tmp_path: Path) -> None:
    """The engine maps the sidecar's memfds: writes on either side are seen by the other."""
    own = [MemfdRegion.create(f"kvs-test-{i}", 8192 + i) for i in range(3)]
    for i, r in enumerate(own):
        r.numpy()[:] = i + 1
    srv = FdServer(str(tmp_path / "e.sock.fds"), AccessPolicy.own_uid())
    await srv.start()
    try:
        token = srv.offer([r.fd for r in own], os.geteuid(), "test")
        refs = [MemfdRef(token, i, r.nbytes) for i, r in enumerate(own)]
        mapped = await asyncio.get_running_loop().run_in_executor(
            None, map_refs, refs, srv.path)
        assert srv.served == 1
    finally:
        await srv.stop()
    for i, (a, b) in enumerate(zip(own, mapped)):
        assert b.nbytes == a.nbytes and b.mem_type == "DRAM"
        assert np.all(b.numpy() == i + 1)
        b.numpy()[7] = 200  # the engine writes ...
        assert a.numpy()[7] == 200  # ... into the sidecar's pages: one copy of the memory
        assert b.address != a.address  # two mappings of the same pages
    for r in own + mapped:
        r.close()


async def test_more_fds_than_one_message_holds(tmp_path: Path) -> None:
    own = [MemfdRegion.create(f"kvs-many-{i}", 4096) for i in range(260)]
    try:
        def fetch(srv: FdServer) -> list[int]:
            token = srv.offer([r.fd for r in own], os.geteuid(), "many")
            return fetch_fds(srv.path, token, len(own))

        fds = await _serving(tmp_path, AccessPolicy.own_uid(), fetch)
        assert len(fds) == 260
        same = [os.fstat(f).st_ino == os.fstat(r.fd).st_ino for f, r in zip(fds, own)]
        assert all(same)  # the very files, in order
        for f in fds:
            os.close(f)
    finally:
        for r in own:
            r.close()


async def test_unknown_token_gets_a_reason_and_no_fds(tmp_path: Path) -> None:
    def fetch(srv: FdServer) -> str:
        srv.offer([0], os.geteuid(), "stdin")
        with pytest.raises(FdPassError, match="unknown token") as e:
            fetch_fds(srv.path, "cd" * 16, 1)
        return str(e.value)

    await _serving(tmp_path, AccessPolicy.own_uid(), fetch)


async def test_withdrawn_offer_is_gone(tmp_path: Path) -> None:
    def fetch(srv: FdServer) -> None:
        token = srv.offer([0], os.geteuid(), "stdin")
        srv.withdraw(token)
        with pytest.raises(FdPassError, match="unknown token"):
            fetch_fds(srv.path, token, 1)
        assert srv.refused == 1

    await _serving(tmp_path, AccessPolicy.own_uid(), fetch)


def test_memfd_mapping_checks_the_size() -> None:
    r = MemfdRegion.create("kvs-small", 4096)
    try:
        with pytest.raises(RegionError, match="holds 4096 B, the region needs 8192 B"):
            MemfdRegion.from_fd(os.dup(r.fd), 8192)
        with pytest.raises(RegionError, match="not been offered"):
            r.ref()
    finally:
        r.close()


def _fetch_as_nobody(path: str, token: str) -> dict[str, Any]:
    def fetch() -> dict[str, Any]:
        try:
            return {"fds": len(fetch_fds(path, token, 1, timeout_s=10))}
        except FdPassError as e:
            return {"error": str(e)}

    return run_as(NOBODY, fetch)


@pytest.mark.parametrize(("allow_nobody", "refusal"), [
    (False, "may not use this sidecar"),  # SO_PEERCRED fails the access policy
    (True, "unknown token"),  # allowed in, but the registration is another uid's
])
async def test_another_user_gets_no_fds(tmp_path: Path, allow_nobody: bool,
                                        refusal: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the other user (nobody) is made by setuid in a child")
    # A directory nobody can traverse to (pytest's own tmp dirs are 0700).
    workdir = Path(tempfile.mkdtemp(prefix="kvs-fd-", dir="/tmp"))
    os.chmod(workdir, 0o755)
    access = (AccessPolicy.of(gids=[NOBODY]) if allow_nobody else AccessPolicy.own_uid())
    region = MemfdRegion.create("kvs-secret", 4096)
    try:
        def attack(srv: FdServer) -> dict[str, Any]:
            # File modes would stop nobody at connect(); open them so that the
            # SO_PEERCRED check is what is tested (root ignores file modes anyway).
            os.chmod(srv.path, 0o666)
            token = srv.offer([region.fd], os.geteuid(), "root's engine")
            return _fetch_as_nobody(srv.path, token)

        got = await _serving(workdir, access, attack)
    finally:
        region.close()
        shutil.rmtree(workdir, ignore_errors=True)
    assert "fds" not in got, got
    assert refusal in got.get("error", ""), got


def _regular_file() -> int:
    fd, path = tempfile.mkstemp(prefix="kvs-regular-")
    os.unlink(path)
    os.ftruncate(fd, 8192)
    return fd


def _unsealed_memfd() -> int:
    fd = os.memfd_create("kvs-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 8192)
    return fd


@pytest.mark.parametrize(("make", "refusal"), [
    (_regular_file, "is not a memfd"),
    (_unsealed_memfd, "not sealed against shrinking"),
])
async def test_the_engine_maps_only_a_size_sealed_memfd(tmp_path: Path, make: Callable[[], int],
                                                        refusal: str) -> None:
    """A sidecar (or whoever answers on its fd socket) hands the engine a regular
    file or an unsealed memfd: the engine library refuses to map it, since whoever
    holds it could truncate it and kill the engine with SIGBUS. The sidecar's own
    memfds are sealed: no one can change their size."""
    bad = make()
    own = MemfdRegion.create("kvs-sealed", 8192)
    try:
        for size in (0, 4096, 16384):
            with pytest.raises(PermissionError):
                os.ftruncate(own.fd, size)

        def fetch(srv: FdServer) -> list[Any]:
            token = srv.offer([bad, own.fd], os.geteuid(), "hostile")
            with pytest.raises(RegionError, match=refusal):
                map_refs([MemfdRef(token, 0, 8192), MemfdRef(token, 1, 8192)], srv.path)
            good = srv.offer([own.fd], os.geteuid(), "sealed")
            return map_refs([MemfdRef(good, 0, 8192)], srv.path)

        (good,) = await _serving(tmp_path, AccessPolicy.own_uid(), fetch)
        good.numpy()[0] = 9
        assert own.numpy()[0] == 9
        good.close()
    finally:
        os.close(bad)
        own.close()


@pytest.mark.parametrize(("grace_s", "outcome"), [(3600.0, "uid_connection_limit"),
                                                  (0.0, "idle_evicted")])
async def test_at_its_share_a_uid_waits_on_its_own_connections(
        tmp_path: Path, grace_s: float, outcome: str) -> None:
    """Other uids admitted, per-uid share 2: a third connection of this uid makes
    room from its own connection waiting longest (past the grace: served,
    ``idle_evicted``), else is refused with a reason naming the uid."""
    refused: list[str] = []
    srv = FdServer(str(tmp_path / "e.sock.fds"), AccessPolicy.of(uids=[os.geteuid() + 4242]),
                   max_connections=8, max_connections_per_uid=2, idle_grace_s=grace_s,
                   on_refuse=refused.append)
    await srv.start()
    held: list[socket.socket] = []
    try:
        token = srv.offer([0], os.geteuid(), "stdin")

        def third() -> str:
            for _ in range(2):  # connected, nothing sent: waiting for their request
                c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                c.connect(srv.path)
                held.append(c)
            try:
                for fd in fetch_fds(srv.path, token, 1):
                    os.close(fd)
            except FdPassError as e:
                return str(e)
            held[0].settimeout(10)
            return f"served; the first got {held[0].recv(64)!r}"

        said = await asyncio.to_thread(third)
    finally:
        await srv.stop()
        for c in held:
            c.close()
    assert refused == [outcome]
    if outcome == "idle_evicted":
        assert said == "served; the first got b''" and srv.served == 1
    else:
        assert said == (f"the sidecar refused to pass file descriptors: uid {os.geteuid()} "
                        "already holds 2 connections to this sidecar's fd socket, the limit "
                        "per uid (--max-engine-connections-per-uid); try again")


async def test_a_flood_of_connects_does_not_hold_the_loop(tmp_path: Path) -> None:
    """Connections waiting in the backlog are accepted (and here refused) one
    per loop turn: other tasks run between them. sock_accept answers at once
    while the backlog is not empty, so a process spinning on connect() held
    the loop for as long as it kept the backlog filled (seen: 0.4-0.7 s gaps
    with two such processes on 2 cores)."""
    turns = LoopTurns()
    seen: list[int] = []  # the loop's turn of each refusal
    srv = FdServer(str(tmp_path / "e.sock.fds"), AccessPolicy.own_uid(), max_connections=1,
                   idle_grace_s=3600, on_refuse=lambda reason: seen.append(turns.n))
    await srv.start()
    flood: list[socket.socket] = []
    try:
        async with turns:
            flood = connect_all(srv.path, 21)  # one kept, 20 refused
            await until(lambda: len(seen) >= 20)
    finally:
        await srv.stop()
        for c in flood:
            c.close()
    assert len(seen) == 20
    assert len(set(seen)) == 20, seen  # the loop turned between every two refusals


def _full_backlog(path: str) -> tuple[socket.socket, list[socket.socket]]:
    """A listener at ``path`` that accepts nothing, its backlog filled."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    queued: list[socket.socket] = []
    while True:  # connects until the backlog takes no more
        c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        c.setblocking(False)
        try:
            c.connect(path)
        except BlockingIOError:
            c.close()
            break
        queued.append(c)
    return listener, queued


def test_a_fetch_that_finds_no_room_says_so(tmp_path: Path) -> None:
    """The backlog stays full for the whole timeout: the fetch fails after it,
    saying why (not a bare EAGAIN)."""
    path = str(tmp_path / "s.fds")
    listener, queued = _full_backlog(path)
    try:
        t0 = time.monotonic()
        with pytest.raises(FdPassError, match=r"listen backlog stayed full for 0.3 s"):
            fetch_fds(path, TOKEN, 1, timeout_s=0.3)
        assert time.monotonic() - t0 >= 0.25
    finally:
        listener.close()
        for c in queued:
            c.close()


def _refuse_the_fetch(listener: socket.socket) -> None:
    """Accept past the flood's silent connections (a full backlog's) to the one
    that asks for TOKEN, and answer it "go away"."""
    listener.settimeout(10)
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(0.1)
            try:
                request = conn.recv(256)
            except TimeoutError:
                continue  # one of the flood's: says nothing
            assert parse_request(request) == TOKEN
            conn.send(encode_error("go away"))
            return


def test_a_signal_does_not_cut_a_fetch_short(tmp_path: Path) -> None:
    """A signal while the fetch waits for room in the backlog (EINTR, which
    Python reports as a connect that succeeded) does not fail it with
    ENOTCONN: it waits on, and gets the sidecar's answer once accepted."""
    path = str(tmp_path / "s.fds")
    listener, queued = _full_backlog(path)
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main
    signalled: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda sig, _frame: signalled.append(sig))

    def sidecar() -> None:
        time.sleep(0.2)
        signal.pthread_kill(main, signal.SIGUSR1)  # the fetch is waiting in connect()
        time.sleep(0.3)
        with contextlib.suppress(OSError):  # closed under it: the fetch ended already
            _refuse_the_fetch(listener)

    t = threading.Thread(target=sidecar)
    t.start()
    try:
        with pytest.raises(FdPassError) as e:
            fetch_fds(path, TOKEN, 1, timeout_s=10)
    finally:
        t.join(10)
        signal.signal(signal.SIGUSR1, old)
        listener.close()
        for c in queued:
            c.close()
    assert signalled == [signal.SIGUSR1]
    assert str(e.value) == "the sidecar refused to pass file descriptors: go away"


def test_a_fetch_waits_for_room_in_a_full_backlog(tmp_path: Path) -> None:
    """The fd socket's listen backlog is full (a flood of connects): the fetch
    waits in the kernel for room, and gets the answer once the sidecar
    accepts, instead of failing at once with EAGAIN."""
    path = str(tmp_path / "s.fds")
    listener, queued = _full_backlog(path)
    said: list[str] = []

    def fetch() -> None:
        try:
            fetch_fds(path, TOKEN, 1, timeout_s=10)
        except FdPassError as e:
            said.append(str(e))

    t = threading.Thread(target=fetch)
    t.start()
    try:
        time.sleep(0.3)
        assert t.is_alive() and said == []  # still waiting for room, not failed
        _refuse_the_fetch(listener)
        t.join(10)
    finally:
        t.join(10)
        listener.close()
        for c in queued:
            c.close()
    assert said == ["the sidecar refused to pass file descriptors: go away"]


def _flood_as(uid: int, path: str, seconds: float, pause_s: float) -> dict[str, Any]:
    """From a child running as ``uid``: open connections to the fd socket at
    ``path`` for ``seconds``, ``pause_s`` apart (0: as fast as connect() goes),
    sending nothing (the newest 128 kept open, older ones closed), and say how
    many it opened."""
    def flood() -> dict[str, Any]:
        kept: collections.deque[socket.socket] = collections.deque()
        opened = failed = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            c.settimeout(1)
            try:
                c.connect(path)
            except OSError:
                failed += 1
                c.close()
                continue
            opened += 1
            kept.append(c)
            if len(kept) > 128:
                kept.popleft().close()
            if pause_s:
                time.sleep(pause_s)
        for c in kept:
            c.close()
        return {"opened": opened, "failed": failed}

    return run_as(uid, flood)


@pytest.mark.parametrize("pause_s", [0.001, 0.0], ids=["paced", "spinning"])
async def test_one_uid_cannot_keep_another_from_its_fds(pause_s: float) -> None:
    """One admitted uid (nobody) opens fd socket connections and sends nothing;
    the sidecar's own uid fetches its registration's fds meanwhile: each fetch
    is served (nobody holds at most its per-uid share of the slots, 48 of 64,
    the rest refused ``uid_connection_limit``), and the server's fds stay
    bounded. Before the per-uid cap, nobody's fresh connections (under the 1 s
    idle grace, so none could be evicted) held all 64 slots and nearly every
    fetch was refused ("too many fd connections"): the registration failed.
    Spinning, nobody also keeps the socket's listen backlog full: a fetch
    connecting with a Python timeout (non-blocking) failed at once with EAGAIN;
    it now waits in the kernel for room (``SO_SNDTIMEO``)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the other user (nobody) is made by setuid in a child")
    workdir = Path(tempfile.mkdtemp(prefix="kvs-fdcap-", dir="/tmp"))
    os.chmod(workdir, 0o755)  # nobody must reach the socket's directory
    refused: list[str] = []
    srv = FdServer(str(workdir / "e.sock.fds"), AccessPolicy.of(uids=[NOBODY]),
                   on_refuse=refused.append)
    region = MemfdRegion.create("kvs-victim", 4096)
    await srv.start()
    os.chmod(srv.path, 0o666)  # the ACL for nobody may be missing on this file system
    try:
        token = srv.offer([region.fd], os.geteuid(), "the victim's engine")
        baseline = len(os.listdir("/proc/self/fd"))

        def victim() -> dict[str, Any]:
            time.sleep(1.5)  # the flood is past the 1 s idle grace: steady state
            served, errors, most_fds, slowest = 0, [], 0, 0.0
            for _ in range(20):
                t0 = time.monotonic()
                try:
                    for fd in fetch_fds(srv.path, token, 1, timeout_s=10):
                        os.close(fd)
                    served += 1
                except FdPassError as e:
                    errors.append(str(e))
                slowest = max(slowest, time.monotonic() - t0)
                most_fds = max(most_fds, len(os.listdir("/proc/self/fd")))
                time.sleep(0.05)
            return {"served": served, "errors": errors, "most_fds": most_fds,
                    "slowest": slowest}

        flood, got = await asyncio.gather(
            asyncio.to_thread(_flood_as, NOBODY, srv.path, 4.0, pause_s), asyncio.to_thread(victim))
    finally:
        await srv.stop()
        region.close()
        shutil.rmtree(workdir, ignore_errors=True)
    assert flood.get("opened", 0) > 500, flood  # a real flood: far more than the slots
    assert got["errors"] == [] and got["served"] == 20, (collections.Counter(got["errors"]), flood)
    assert "uid_connection_limit" in refused and "connection_limit" not in refused
    assert got["most_fds"] - baseline < 64 + 16, (got["most_fds"], baseline)
    print(f"flood {flood}; fetches {got['served']} served, slowest {got['slowest']:.3f} s, "
          f"fds {baseline} -> at most {got['most_fds']}; refused {collections.Counter(refused)}")


async def test_the_fd_socket_accepts_again_after_running_out_of_fds(tmp_path: Path) -> None:
    """An accept that fails for want of fds (EMFILE) pauses the fd socket, which
    then accepts again: before, the first such error ended its accept task for
    good and every later fetch, so every registration, failed."""
    import resource

    srv = FdServer(str(tmp_path / "e.sock.fds"), AccessPolicy.own_uid(), timeout_s=5,
                   idle_grace_s=3600)
    await srv.start()
    region = MemfdRegion.create("kvs-test-emfile", 4096)
    clients = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(4)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        token = srv.offer([region.fd], os.geteuid(), "emfile")
        # Room for one more fd in this process: the server accepts one client, and
        # the next accept fails with EMFILE (the clients' sockets exist already).
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
        for c in clients:
            c.setblocking(False)
            c.connect(srv.path)
        for _ in range(200):
            if srv.accept_errors:
                break
            await asyncio.sleep(0.01)
        assert srv.accept_errors > 0
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        fds = await asyncio.get_running_loop().run_in_executor(
            None, lambda: fetch_fds(srv.path, token, 1, timeout_s=5))
        assert len(fds) == 1 and os.fstat(fds[0]).st_size == 4096
        os.close(fds[0])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for c in clients:
            c.close()
        await srv.stop()
        region.close()
