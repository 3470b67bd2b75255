"""The README's code runs as written, and the documents it links exist.

The sidecar is started by the README's own commands (the indented block that
exports ``KVSIDECAR_SOCKET``, makes a key with ``kvsidecar keys`` and runs
``kvsidecar serve``), each line run by bash as written, in a user's
environment: no ``KVSIDECAR_*`` variable or key of the test harness, a home
of its own. Then every fenced ``python`` block runs in a fresh interpreter
and every fenced ``bash``/``sh`` block in a shell, with that environment.
Fenced blocks without a language (diagrams) and ``text`` blocks are not code.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, re.M | re.S)
CODE = [(lang, body) for lang, body in BLOCKS if lang in ("python", "bash", "sh")]
#: The README's commands that start the sidecar its example runs against.
START = re.search(r"^    export KVSIDECAR_SOCKET=.*?(?=\n\n)", README, re.M | re.S)
#: The example's socket directory, in the README; each run uses its own instead.
EXAMPLE_DIR = "/tmp/kvsidecar-example"


def test_readme_has_code_to_run() -> None:
    assert any(lang == "python" for lang, _ in CODE)


def test_readme_says_how_to_start_the_sidecar() -> None:
    assert START is not None
    lines = [ln.strip() for ln in START.group(0).splitlines()]
    assert any(ln.startswith(".venv/bin/kvsidecar serve ") for ln in lines), lines
    assert any(ln.startswith(".venv/bin/kvsidecar keys ") for ln in lines), lines


def _user_env(home: Path) -> dict[str, str]:
    """A user's environment: nothing of the harness's sidecar settings or keys."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVSIDECAR_") and k not in ("CREDENTIALS_DIRECTORY",
                                                            "RUNTIME_DIRECTORY")}
    return {**env, "HOME": str(home)}


def _as_here(line: str, work: Path) -> str:
    """The README's line with this checkout's interpreter for ``.venv/bin`` (the
    virtual environment ``make`` creates) and this run's own socket directory."""
    kvsidecar = f"{shlex.quote(sys.executable)} -m kvsidecar"
    return line.strip().replace(".venv/bin/kvsidecar", kvsidecar).replace(
        EXAMPLE_DIR, str(work / "example"))


@pytest.mark.e2e
@pytest.mark.parametrize(("lang", "body"), CODE, ids=[f"{lang}-{i}" for i, (lang, _) in
                                                        enumerate(CODE)])
def test_readme_block_runs_as_written(lang: str, body: str) -> None:
    assert START is not None
    work = Path(tempfile.mkdtemp(prefix="kvs-readme-", dir="/tmp"))
    (work / "home").mkdir()
    env = _user_env(work / "home")
    serve: subprocess.Popen[str] | None = None
    try:
        for line in START.group(0).splitlines():
            line = _as_here(line, work)
            if line.startswith("export "):
                name, _, value = line.removeprefix("export ").partition("=")
                env[name] = value
            elif " serve " in line:
                with open(work / "serve.log", "w") as log:
                    serve = subprocess.Popen(["bash", "-c", "exec " + line.removesuffix("&")],
                                             env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                             stderr=log, text=True)
                assert serve.stdout is not None
                first = serve.stdout.readline()  # READY, or nothing when it refused
                assert first.startswith("KVSIDECAR READY "), (
                    line, first, (work / "serve.log").read_text()[-3000:])
            else:
                out = subprocess.run(["bash", "-euc", line], env=env, cwd=ROOT,
                                     capture_output=True, text=True, timeout=60)
                assert out.returncode == 0, (line, out.stdout + out.stderr)
        assert serve is not None
        cmd = [sys.executable, "-c", body] if lang == "python" else ["bash", "-euc", body]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                             cwd=ROOT)
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            serve.communicate(timeout=60)
            assert serve.returncode in (0, 2), (work / "serve.log").read_text()[-3000:]
    assert serve.returncode == 0, (work / "serve.log").read_text()[-3000:]
    shutil.rmtree(work, ignore_errors=True)


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
    # issue #31: the demo's ratio to one READ comes with the CPU bound that stops it
    assert re.search(r"bound on this host: the sidecars ran \d+\.\d ms of CPU in that time, at "
                     r"least \d+\.\d ms on its \d+ cores: \d+\.\d\dx one READ at best",
                     out.stdout), out.stdout
    assert not [ln for ln in out.stdout.splitlines() if "NIXL" in ln and "INFO" in ln]
    assert not list(tmp_path.glob("kvsidecar-demo-*"))
