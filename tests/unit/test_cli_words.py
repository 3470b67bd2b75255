"""What a user reads from the command lines: ``kvsidecar --help`` is a
description, not a docstring; an unknown flag names the command it was given
to; ``--advertise-host`` takes host names and addresses only; the module
commands answer ``--help`` and say what they need."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.cli import main
from kvsidecar.daemon import options_doc
from kvsidecar.daemon.options import host
from kvsidecar.daemon.transport import check


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


def test_help_describes_the_tool_without_markup(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    assert "per-GPU KV-cache transfer daemon" in out
    assert "``" not in out and ":mod:" not in out and "It lives above" not in out


@pytest.mark.parametrize("cmd", ["serve", "status", "keys"])
def test_an_unknown_flag_names_its_command(cmd: str, capsys: pytest.CaptureFixture[str]
                                           ) -> None:
    argv = [cmd, *(["dir"] if cmd == "keys" else []), "--bogus"]
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    assert err.strip() == (f"kvsidecar {cmd}: error: unrecognized arguments: --bogus "
                           f"(see kvsidecar {cmd} --help)")


@pytest.mark.parametrize("value", ["", "10.0.0.1", "::1", "[fe80::1]", "node-7",
                                   "gpu3.rack2.example.com", "example.com."])
def test_advertise_host_takes_names_and_addresses(value: str) -> None:
    assert host(value) is None


@pytest.mark.parametrize("value", ["not_a_host!", "-lead", "a..b", "x" * 64, "10.0.0.1:5600",
                                   "http://h"])
def test_advertise_host_refuses_the_rest(value: str) -> None:
    assert host(value) == f"must be a host name or an IP address, got {value!r}"


def test_options_doc_outside_a_checkout_says_what_it_needs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        options_doc.main(["--check", str(tmp_path / "docs" / "configuration.md")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run it from a checkout" in err, err


def test_transport_check_answers_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m kvsidecar.daemon.transport.check")
    assert "KVSIDECAR CHECK" not in out.splitlines()[-1]
    assert check.main(["--bogus"]) == 2
    assert "takes no arguments" in capsys.readouterr().err
