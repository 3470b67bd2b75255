"""The engine socket's directory: a path with ``..`` (or a relative one) is
checked as the directory it names, and a directory that already existed is
never chmodded or chowned (a ``--socket /tmp/new/../x.sock`` once set /tmp to
0700 as root, and skipped the writable-by-others check)."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from kvsidecar.daemon import settings
from kvsidecar.daemon.engine_access import prepare_socket_dir
from kvsidecar.daemon.preflight import Refusal, preflight


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def sandbox(tmp_path: Path) -> Path:
    """A directory anyone may write, sticky, as /tmp is (ours, in our own temp dir)."""
    sb = tmp_path / "sb"
    sb.mkdir()
    os.chmod(sb, 0o1777)
    return sb


def test_a_dotdot_path_is_checked_as_the_directory_it_names(sandbox: Path) -> None:
    with pytest.raises(PermissionError, match="writable by others"):
        prepare_socket_dir(str(sandbox / "new" / ".."), shared=False)
    assert _mode(sandbox) == 0o1777


def test_a_new_directory_is_made_private(tmp_path: Path) -> None:
    prepare_socket_dir(str(tmp_path / "a" / "b"), shared=False)
    assert _mode(tmp_path / "a" / "b") == 0o700
    prepare_socket_dir(str(tmp_path / "c"), shared=True)
    assert _mode(tmp_path / "c") == 0o750


def test_an_existing_directory_is_checked_not_changed(tmp_path: Path) -> None:
    d = tmp_path / "mine"
    d.mkdir()
    os.chmod(d, 0o755)
    prepare_socket_dir(str(d), shared=False)
    assert _mode(d) == 0o755
    prepare_socket_dir(str(d / "x" / ".."), shared=True)  # "x" is made, "mine" left alone
    assert _mode(d) == 0o755


def parse(argv: list[str]) -> settings.Settings:
    p = argparse.ArgumentParser()
    settings.add_arguments(p)
    return settings.from_args(p.parse_args(argv))


def test_the_socket_path_is_absolute_and_normalised(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse(["--socket", f"{tmp_path}/sb/new/../x.sock"]).socket == f"{tmp_path}/sb/x.sock"
    monkeypatch.chdir(tmp_path)
    assert parse(["--socket", "relative.sock"]).socket == f"{tmp_path}/relative.sock"


def test_preflight_refuses_a_dotdot_socket_in_an_open_directory(
        sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = parse(["--socket", f"{sandbox}/new/../x.sock", "--insecure-peers"])
    with pytest.raises(Refusal, match=f"socket directory {sandbox} is writable by others"):
        preflight(s)
    assert _mode(sandbox) == 0o1777
