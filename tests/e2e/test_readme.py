"""The README's code runs as written, and the documents it links exist.

Every fenced ``python`` block runs in a fresh interpreter against a real
``kvsidecar serve`` (its socket in ``KVSIDECAR_SOCKET``, as the README says);
every fenced ``bash``/``sh`` block runs in a shell. Fenced blocks without a
language (diagrams) and ``text`` blocks are not code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvsidecar.sim.cluster import SidecarProcess

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, re.M | re.S)
CODE = [(lang, body) for lang, body in BLOCKS if lang in ("python", "bash", "sh")]


def test_readme_has_code_to_run() -> None:
    assert any(lang == "python" for lang, _ in CODE)


@pytest.mark.e2e
@pytest.mark.parametrize(("lang", "body"), CODE, ids=[f"{lang}-{i}" for i, (lang, _) in
                                                        enumerate(CODE)])
def test_readme_block_runs_as_written(lang: str, body: str) -> None:
    work = Path(tempfile.mkdtemp(prefix="kvs-readme-", dir="/tmp"))
    sidecar = SidecarProcess(work, "readme", args=["--transport-check", "off"]).start()
    try:
        env = {**os.environ, "KVSIDECAR_SOCKET": sidecar.socket}
        cmd = [sys.executable, "-c", body] if lang == "python" else ["bash", "-euc", body]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                             cwd=ROOT)
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        assert sidecar.stop() == 0, sidecar.read_log()


def test_documents_the_readme_links_exist() -> None:
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target
    for path in re.findall(r"`((?:docs|deploy|dashboards|systemd|scripts)/[\w./@-]+)`", README):
        assert (ROOT / path).exists(), path


def test_license_is_apache_2() -> None:
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.e2e
def test_demo_table_is_clean_and_demo_leaves_nothing_in_tmp(tmp_path: Path) -> None:
    """`kvsidecar demo` (what `make demo` runs): its stdout is the demo's own lines
    only (no library logs inside the table) and its work directory is removed."""
    out = subprocess.run([sys.executable, "-m", "kvsidecar", "demo", "--requests", "2",
                          "--layers", "2"], env={**os.environ, "TMPDIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "RESULT: OK" in out.stdout
    assert not [ln for ln in out.stdout.splitlines() if "NIXL" in ln and "INFO" in ln]
    assert not list(tmp_path.glob("kvsidecar-demo-*"))
