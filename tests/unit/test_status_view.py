"""``kvsidecar status``'s rendering (ipc/status_view.py) and exit status, on
reports built here: the states a live test cannot hold still (not ready,
draining) and the ages' formats."""

from __future__ import annotations

import json

import pytest

from kvsidecar.ipc.protocol import EngineStatus, PeerStatus, StatusCheck, StatusReport
from kvsidecar.ipc.status_view import as_json, render


def _report(**kw: object) -> StatusReport:
    base: dict[str, object] = dict(
        version="9.8.7", daemon_id="abc", uptime_s=3725.0, socket="/run/s.sock",
        handshake_address="10.0.0.1:5600", ready=True, draining=False, transport="cma",
        checks=[StatusCheck("event_loop", True, "fine")],
        engines=[EngineStatus("dec", 1, 2, pid=42, lanes=2, reads=3, oldest_read_s=75.5,
                              holds=0, queued=4, peers_linked=1,
                              peers=[PeerStatus("10.0.0.2:5600", "pre", 0, "9.8.6", 2)])])
    base.update(kw)
    return StatusReport(**base)  # type: ignore[arg-type]


def test_a_ready_sidecar() -> None:
    lines = render(_report()).splitlines()
    assert lines[0] == "kvsidecar 9.8.7  daemon abc  up 1h02m  ready"
    assert lines[1] == "engines on /run/s.sock, handshakes on 10.0.0.1:5600, transport cma"
    assert lines[2] == ("1 engine rank(s); 3 read(s) in flight (oldest 1m15s); 0 hold(s) open "
                        "(oldest -); 1 peer link(s)")
    assert lines[4].split() == ["ENGINE", "RANK", "PID", "LANES", "READS", "OLDEST", "HOLDS",
                                "OLDEST", "QUEUED", "PEERS"]
    assert lines[5].split() == ["dec", "1/2", "42", "2", "3", "1m15s", "0", "-", "4", "1"]
    assert lines[8].split() == ["dec/1", "10.0.0.2:5600", "pre", "0", "9.8.6", "2"]


def test_not_ready_names_each_failed_check() -> None:
    r = _report(ready=False, transport="checking", engines=[], checks=[
        StatusCheck("event_loop", True, "fine"),
        StatusCheck("transport_selfcheck", False, "still running")])
    assert render(r).splitlines()[:3] == [
        "kvsidecar 9.8.7  daemon abc  up 1h02m  NOT READY",
        "engines on /run/s.sock, handshakes on 10.0.0.1:5600, transport checking",
        "  failed check transport_selfcheck: still running"]


def test_draining_is_said_first() -> None:
    r = _report(ready=False, draining=True,
                checks=[StatusCheck("not_draining", False, "draining: shutting down")])
    assert render(r).splitlines()[0].endswith("  draining")


def test_ended_engines_draining_their_holds_are_counted() -> None:
    lines = render(_report(engines_draining=2, drain_bytes=6291456)).splitlines()
    assert lines[3] == "2 ended engine(s) draining their holds (6291456 B kept for them)"
    assert not any("draining their holds" in x for x in render(_report()).splitlines())


def test_json_is_the_reports_fields() -> None:
    doc = json.loads(as_json(_report()))
    assert "id" not in doc and "op" not in doc
    assert doc["engines"][0]["peers"][0]["version"] == "9.8.6"
    assert doc["uptime_s"] == 3725.0


@pytest.mark.parametrize(("ready", "draining", "code"), [(True, False, 0), (False, False, 1),
                                                         (False, True, 1)])
def test_exit_status(monkeypatch: pytest.MonkeyPatch, tmp_path: object, ready: bool,
                     draining: bool, code: int, capsys: pytest.CaptureFixture[str]) -> None:
    """0 ready, 1 answered but not ready or draining (the client is the real one's
    stand-in: a sidecar cannot be held in these states on demand)."""
    import kvsidecar.ipc.client as client_mod
    from kvsidecar import cli

    class Answering:
        def __init__(self, socket: str, timeout_s: float) -> None:
            pass

        def __enter__(self) -> Answering:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def status(self) -> StatusReport:
            return _report(ready=ready, draining=draining)

    monkeypatch.setattr(client_mod, "SidecarClient", Answering)
    monkeypatch.setattr(cli.os.path, "exists", lambda _p: True)
    assert cli.main(["status", "--socket", "/run/s.sock"]) == code
    assert capsys.readouterr().out.startswith("kvsidecar 9.8.7  daemon abc")


def test_a_report_lists_the_most_recently_used_links_of_an_engine_only() -> None:
    """daemon/status.engine_status on an engine rank's parts (plain stand-ins:
    the function reads attributes only); 40 links, LRU first as PeerLinks
    keeps them: the 32 most recent are listed, newest first, all 40 counted."""
    from types import SimpleNamespace

    from kvsidecar.daemon.holds import HoldBook
    from kvsidecar.daemon.status import engine_status
    from kvsidecar.ipc.protocol import MAX_STATUS_PEERS

    links = [(SimpleNamespace(key=(f"10.0.0.{i}:5600", "pre", 0),
                              info=SimpleNamespace(sidecar_version="1.2.3")), i % 2)
             for i in range(40)]
    holds = HoldBook(default_timeout_s=60, grace_s=1, on_done=lambda _o: None)
    holds.add("dec", "h1", 1, 1, None, now=100.0)
    holds.add("dec", "h2", 1, 1, None, now=103.0)
    eng = SimpleNamespace(engine_id="dec", tp_rank=0, layout=SimpleNamespace(tp_size=1),
                          pid=7, lanes=[None], holds=holds, completions=[1, 2],
                          peers=SimpleNamespace(linked=lambda: links))
    e = engine_status(eng, reads=3, oldest_read_s=1.23456, now=110.0)  # type: ignore[arg-type]
    assert (e.reads, e.oldest_read_s, e.holds, e.oldest_hold_s, e.queued) == (
        3, 1.235, 2, 10.0, 2)
    assert MAX_STATUS_PEERS == 32 and e.peers_linked == 40
    assert [p.address for p in e.peers] == [f"10.0.0.{i}:5600" for i in range(39, 7, -1)]
    assert [p.reads for p in e.peers[:2]] == [1, 0]


def test_a_peer_version_cannot_write_to_the_terminal() -> None:
    """A linked peer's version comes from its handshake (any string, any length):
    its control characters (a terminal's escape sequences) are shown escaped and
    a long one is cut, so ``kvsidecar status`` prints what the report says and
    nothing a peer chose to do to the operator's terminal."""
    evil = "\x1b[2J\x1b]0;owned\x07" + "9" * 10_000
    r = _report(engines=[EngineStatus("dec", 1, 2, pid=42, lanes=2, reads=0, oldest_read_s=0.0,
                                      holds=0, queued=0, peers_linked=1,
                                      peers=[PeerStatus("10.0.0.2:5600", "pre", 0, evil, 2)])])
    out = render(r)
    assert "\x1b" not in out and "\x07" not in out
    assert max(len(line) for line in out.splitlines()) < 200
    row = out.splitlines()[-1].split()
    assert row[:4] == ["dec/1", "10.0.0.2:5600", "pre", "0"] and row[-1] == "2"
    assert row[4].startswith("\\x1b[2J\\x1b]0;owned\\x0799") and row[4].endswith("\u2026")
