"""The option table (daemon/options.py) is what argparse, the environment and
Settings do: one option per Settings field, each flag read from its variable,
flags over variables, the table's defaults are Settings' defaults, and
``--help`` names every variable and default."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest

from kvsidecar.daemon import options, settings
from kvsidecar.daemon.options import OPTIONS, Option


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for opt in OPTIONS:
        monkeypatch.delenv(opt.env, raising=False)
        if opt.env_fallback:
            monkeypatch.delenv(opt.env_fallback, raising=False)
    return monkeypatch


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvsidecar serve")
    settings.add_arguments(p)
    return p


def test_one_option_per_settings_field() -> None:
    fields = [f.name for f in dataclasses.fields(settings.Settings)]
    assert sorted(o.field for o in OPTIONS) == sorted(fields)


def test_names_are_unique_and_follow_the_flag() -> None:
    for key in ("flag", "env", "dest", "field"):
        values = [getattr(o, key) for o in OPTIONS]
        assert len(set(values)) == len(values), key
    for o in OPTIONS:
        assert o.flag.startswith("--") and o.flag == o.flag.lower()
        assert o.section in options.SECTIONS and o.help.strip() == o.help
    assert options.BY_FIELD["hold_timeout_s"].env == "KVSIDECAR_HOLD_TIMEOUT"
    assert options.BY_FIELD["allow_uids"].env == "KVSIDECAR_ALLOW_UID"


def test_table_defaults_are_the_settings_defaults(clean_env: pytest.MonkeyPatch) -> None:
    """Nothing on the command line, nothing in the environment: the Settings that
    from_args builds from the table's defaults is the dataclass's own default."""
    s = settings.from_args(parser().parse_args(["--socket", "/x.sock"]))
    assert s == settings.Settings(socket="/x.sock")


def test_table_defaults_pass_their_own_checks() -> None:
    for o in OPTIONS:
        assert o.complaint(o.default) is None, o.flag
        if o.choices:
            assert o.default in o.choices, o.flag


def _other(opt: Option) -> str:
    """A text for the option's flag or variable that parses to a non-default value."""
    if opt.kind == "switch":
        return "1"
    if opt.kind in ("int", "float"):
        return str(int(opt.default) + 1)
    return next((c for c in opt.choices if c != opt.default), "/other")


def _parsed(opt: Option, text: str) -> object:
    return {"int": int, "float": float, "switch": bool, "str": str}[opt.kind](text)


@pytest.mark.parametrize("opt", OPTIONS, ids=[o.flag for o in OPTIONS])
def test_each_variable_sets_its_flag_and_the_flag_wins(opt: Option,
                                                       clean_env: pytest.MonkeyPatch) -> None:
    text = _other(opt)
    clean_env.setenv(opt.env, text)
    assert getattr(parser().parse_args([]), opt.dest) == _parsed(opt, text) != opt.default
    if opt.kind != "switch":
        assert getattr(parser().parse_args([opt.flag, str(opt.default)]), opt.dest) \
            == opt.default
    if opt.kind == "switch":
        for on in ("1", "true", "TRUE", "yes", "On", " on "):
            clean_env.setenv(opt.env, on)
            assert getattr(parser().parse_args([]), opt.dest) is True, on
        for off in ("", "0", "false", "False", "no", "NO", "off", " off "):
            clean_env.setenv(opt.env, off)
            assert getattr(parser().parse_args([]), opt.dest) is False, off
            assert getattr(parser().parse_args([opt.flag]), opt.dest) is True


@pytest.mark.parametrize("opt", [o for o in OPTIONS if o.kind == "switch"],
                         ids=lambda o: o.flag)
@pytest.mark.parametrize("bad", ["maybe", "2", "enabled", "nope"])
def test_a_switch_variable_with_another_value_is_refused(
        opt: Option, bad: str, clean_env: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``KVSIDECAR_INSECURE_PEERS=maybe`` (or ``nope``) once turned peer
    authentication off: any value but the listed ones is a usage error naming
    the variable and the accepted values, exit 2."""
    clean_env.setenv(opt.env, bad)
    with pytest.raises(SystemExit) as e:
        parser().parse_args([])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"kvsidecar serve: error: argument {opt.flag}: must be 1/true/yes/on (on) "
                   f"or empty/0/false/no/off (off), any case (env {opt.env}), got {bad!r}")


def test_peer_keys_fall_back_to_systemd_credentials(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("CREDENTIALS_DIRECTORY", "/run/credentials/kvsidecar@0.service")
    assert parser().parse_args([]).peer_keys == "/run/credentials/kvsidecar@0.service"
    clean_env.setenv("KVSIDECAR_PEER_KEYS", "/etc/kvsidecar/keys")
    assert parser().parse_args([]).peer_keys == "/etc/kvsidecar/keys"


def test_help_names_each_variable_and_default() -> None:
    by_flag = {a.option_strings[0]: a for a in parser()._actions if a.option_strings}
    for o in OPTIONS:
        text = by_flag[o.flag].help or ""
        assert o.help.replace("%", "%%") in text and f"(env {o.env}" in text, o.flag
        assert "; default " + o.shown_default().replace("`", "") + ")" in text, o.flag
    assert "25%" in parser().format_help()  # a % in a help text is escaped for argparse


def test_help_is_grouped_by_section() -> None:
    out = parser().format_help()
    headings = sorted((out.index(f"\n{title}:\n"), title) for title in options.SECTIONS)
    assert [t for _, t in headings] == list(options.SECTIONS)
    for o in OPTIONS:
        at = out.index(f"\n  {o.flag} ")
        assert [t for i, t in headings if i < at][-1] == o.section, o.flag


def test_seconds_bounds() -> None:
    positive, zero_ok = options.seconds(), options.seconds(zero=True)
    for v in (0.0, -1.0, math.nan, math.inf, options.MAX_SECONDS + 1):
        assert positive(v) == ("must be a finite number of seconds in (0, 86400], "
                               f"got {v}")
    assert positive(options.MAX_SECONDS) is None and positive(0.001) is None
    assert zero_ok(0.0) is None and zero_ok(options.MAX_SECONDS) is None
    assert zero_ok(-0.5) == "must be a finite number of seconds in [0, 86400], got -0.5"
    assert zero_ok(math.nan) is not None


def test_range_port_and_choice_wording() -> None:
    assert options.within(1, 8)(0) == "must be 1..8, got 0"
    assert options.within(1, 8)(8) is None and options.within(1, 8)(9) is not None
    long_msg = options.within(0, 3600, unit="seconds", above_lo=True)
    assert long_msg(0.0) == "must be 0..3600 seconds (not 0), got 0.0"
    assert long_msg(3600.0) is None and long_msg(math.nan) is not None
    assert options.port()(-1) == "must be a port 0..65535, got -1"
    assert options.port(off=True)(-1) is None
    assert options.port(off=True)(65536) == "must be a port 0..65535 or -1 (off), got 65536"
    assert options.one_of(("text", "json"))("xml") == "must be text or json, got 'xml'"
    levels = options.one_of(options.LOG_LEVELS, any_case=True)
    assert levels("debug") is None
    assert levels("loud") == "must be one of DEBUG, INFO, WARNING, ERROR, got 'loud'"
    assert options.at_least(1)(0) == "must be >= 1, got 0"
    assert options.positive(0) == "must be > 0, got 0"
    assert options.device("cuda:12") is None and options.device("cuda") is not None
    assert options.some_backend(" , ") == "names no backend; e.g. UCX"


def test_transport_check_choices_are_the_checks_modes() -> None:
    from kvsidecar.daemon.transport import check

    assert options.CHECK_MODES == check.MODES
