"""The version a user can name (#26): one source (``kvsidecar.__version__``),
shown by ``kvsidecar --version``, the build-info metric, the CHANGELOG's newest
release, and sent in the peer handshake in a field older sidecars skip and
whose absence newer ones take for "unknown"."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec
import pytest

import kvsidecar
from kvsidecar.cli import main
from kvsidecar.daemon.peers.messages import HandshakeInfo, decode_info, make_handshake_info
from kvsidecar.metrics.registry import Metrics
from kvsidecar.sim.models import hybrid

ROOT = Path(__file__).resolve().parents[2]


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"kvsidecar {kvsidecar.__version__}\n"


def test_the_package_version_comes_from_one_place() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", kvsidecar.__version__)
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "kvsidecar.__version__"}


def test_the_changelog_names_this_release_under_unreleased() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    heads = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert heads[:2] == ["Unreleased", kvsidecar.__version__]


def test_build_info_series_carries_the_version() -> None:
    text = Metrics().render(False).decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("kvsidecar_build_info{"))
    assert f'version="{kvsidecar.__version__}"' in line and line.endswith(" 1.0")


def _info() -> HandshakeInfo:
    return make_handshake_info(engine_id="p", tp_rank=0, agent_name="a", agent_metadata=b"m",
                               layout=hybrid(1, 8), bases=[4096] * hybrid(1, 8).num_regions,
                               daemon_id="d1")


def test_the_handshake_carries_the_version() -> None:
    info = _info()
    assert info.sidecar_version == kvsidecar.__version__
    assert decode_info(msgspec.msgpack.encode(info)).sidecar_version == kvsidecar.__version__


def test_an_older_sidecars_handshake_decodes_with_no_version() -> None:
    fields = msgspec.to_builtins(_info(), builtin_types=(bytes,))
    del fields["sidecar_version"]  # what a sidecar older than the field sends
    assert decode_info(msgspec.msgpack.encode(fields)).sidecar_version == ""


def test_an_older_sidecar_decodes_this_handshake() -> None:
    """HandshakeInfo as it was before the field: the new field is skipped."""
    types = typing.get_type_hints(HandshakeInfo)
    fields = [(f.name, types[f.name]) if f.default is msgspec.NODEFAULT
              else (f.name, types[f.name], f.default)
              for f in msgspec.structs.fields(HandshakeInfo) if f.name != "sidecar_version"]
    Old = msgspec.defstruct("Old", fields, kw_only=True, frozen=True)
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(_info()), type=Old)
    assert old.daemon_id == "d1" and not hasattr(old, "sidecar_version")
