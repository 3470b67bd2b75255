"""The readiness check's view of the handshake listener (``ListenerProbe``),
against a fake /proc: a socket of this process listening on the port, from
the kernel's tables, and nothing else counts. It never connects (a connect
is a failed peer handshake: tests/e2e/test_probes.py)."""

from __future__ import annotations

import os
from pathlib import Path

from kvsidecar.daemon.observability import ListenerProbe

HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt"
          "   uid  timeout inode\n")


def row(local: str, state: str, inode: int) -> str:
    return (f"   0: {local} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000"
            f"     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n")


def fake_proc(tmp_path: Path, tcp: list[str], tcp6: list[str] | None,
              own: list[int]) -> Path:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(HEADER + "".join(tcp))
    if tcp6 is not None:
        (tmp_path / "net" / "tcp6").write_text(HEADER + "".join(tcp6))
    fds = tmp_path / "self" / "fd"
    fds.mkdir(parents=True)
    os.symlink("/dev/null", fds / "0")
    for n, inode in enumerate(own, start=3):
        os.symlink(f"socket:[{inode}]", fds / str(n))
    return tmp_path


PORT = 5603  # 0x15E3


def test_own_listening_socket_on_the_port(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, [row("0100007F:15E3", "0A", 777)], None, own=[777])
    assert ListenerProbe(str(proc)).listening(PORT)


def test_ipv6_listener(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, [], [row("00000000000000000000000000000000:15E3", "0A", 9)],
                     own=[9])
    assert ListenerProbe(str(proc)).listening(PORT)


def test_another_processs_listener_or_a_connection_does_not_count(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, [
        row("0100007F:15E3", "0A", 555),        # listening, but not our socket
        row("0100007F:15E3", "01", 777),        # ours, but an established connection
        row("0100007F:15E4", "0A", 778),        # ours, listening, another port
    ], [], own=[777, 778])
    assert not ListenerProbe(str(proc)).listening(PORT)


def test_listener_gone_after_it_was_seen(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, [row("0100007F:15E3", "0A", 777)], [], own=[777])
    probe = ListenerProbe(str(proc))
    assert probe.listening(PORT)
    (proc / "net" / "tcp").write_text(HEADER)
    assert not probe.listening(PORT)


def test_a_real_listener_is_asked_directly_once_found(monkeypatch) -> None:
    """Once found, the probe asks the socket itself (its fd, still listening on
    the port) and reads no table; a closed listener is noticed."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    probe = ListenerProbe()
    assert probe.listening(port)
    tables: list[int] = []
    real = probe._listening_inodes
    monkeypatch.setattr(probe, "_listening_inodes",
                        lambda p: tables.append(p) or real(p))
    for _ in range(3):
        assert probe.listening(port)
    assert tables == []
    assert not probe.listening(port + 1 if port < 65535 else port - 1)
    s.close()
    assert not probe.listening(port)
