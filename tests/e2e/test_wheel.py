"""The built package, installed as a user installs it, and the image recipe that
builds it (Containerfile). The wheel and the sdist are built from a copy of this
checkout, the wheel goes (not editable) into a fresh
venv under the temporary folder, and the ``kvsidecar`` command runs from a
folder outside the checkout with nothing of the checkout on its path.

The wheel's file list is compared with the source tree: every runtime module
(every ``.py`` outside the repository-only folders) is in it, nothing else is.
The expected list is computed here from the tree, not from setup.py's rule.

Cost (2-core CI): one build and one venv per session, about 30 s to install
torch (CPU, ``$TORCH_SPEC``, the Makefile's) and the wheel's dependencies, and
about 25 s for ``kvsidecar demo``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvsidecar

ROOT = Path(__file__).resolve().parents[2]
#: Top-level folders of the repository that are not part of the runtime package.
REPO_ONLY = {"tests", "benchmarks", "scripts", "deploy", "docs", "dashboards", "systemd"}
#: Root files that build the package and are not modules of it.
BUILD_FILES = {"setup.py"}
#: Non-Python files the wheel carries (pyproject's package-data).
PACKAGE_DATA = {"py.typed"}
#: Installed into the fresh venv before the wheel: nixl depends on torch, and
#: the default index's torch is a multi-GB CUDA build (see the Makefile).
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
#: How the wheel is built, here and in the Containerfile's build stage.
BUILD_WHEEL = ["pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir"]

pytestmark = pytest.mark.timeout(900)


def _skip_copy(folder: str, names: list[str]) -> set[str]:
    """What a clean clone lacks: dot folders (.git, .venv, caches), build output."""
    return {n for n in names if (n.startswith(".") and n != ".gitignore") or n in (
        "build", "dist", "__pycache__") or n.endswith(".egg-info")}


def _runtime_modules(tree: Path) -> set[str]:
    """``kvsidecar/<path>`` of every ``.py`` file of ``tree`` outside REPO_ONLY."""
    out = set()
    for folder, dirs, files in os.walk(tree):
        here = Path(folder).relative_to(tree)
        skip = _skip_copy(folder, dirs) | (REPO_ONLY if here == Path(".") else set())
        dirs[:] = [d for d in dirs if d not in skip]
        out |= {f"kvsidecar/{(here / f).as_posix()}" for f in files
                if f.endswith(".py") and str(here / f) not in BUILD_FILES}
    return out


@dataclass
class Built:
    wheel: Path
    sdist: Path
    venv: Path
    elsewhere: Path  # a working folder outside the checkout
    env: dict[str, str]

    def run(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=self.elsewhere, env=self.env, capture_output=True,
                              text=True, timeout=timeout)


def _pip(python: Path | str, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q",
                    "--disable-pip-version-check", *args], check=True, timeout=900)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=_skip_copy, symlinks=True)
    dist.mkdir()
    # The image's builder stage runs the same build command (Containerfile).
    import setuptools  # the `test` extra pins it: the build runs offline, no isolation

    assert int(setuptools.__version__.split(".")[0]) >= 77, setuptools.__version__
    subprocess.run([sys.executable, "-m", *BUILD_WHEEL, str(dist), ".", "-q"],
                   cwd=src, check=True, timeout=600)
    subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                    "build_meta.build_sdist(sys.argv[1])", str(dist)],
                   cwd=src, check=True, timeout=600, capture_output=True)
    (wheel,) = dist.glob("kvsidecar-*.whl")
    (sdist,) = dist.glob("kvsidecar-*.tar.gz")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    _pip(python, *shlex.split(TORCH_SPEC))
    _pip(python, str(wheel))
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and
           not (k.startswith("KVSIDECAR_") and k != "KVSIDECAR_REQUIRE_VLLM")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    yield Built(wheel, sdist, venv, elsewhere, env)


def test_the_wheel_holds_every_runtime_module_and_nothing_else(built: Built) -> None:
    names = set(zipfile.ZipFile(built.wheel).namelist())
    shipped = {n for n in names if not n.startswith("kvsidecar-")}
    expected = _runtime_modules(ROOT) | {f"kvsidecar/{d}" for d in PACKAGE_DATA}
    assert sorted(shipped - expected) == []
    assert sorted(expected - shipped) == []
    assert "kvsidecar/daemon/peers/messages.py" in shipped  # the module #26 found missing


def test_every_folder_with_runtime_modules_is_a_package() -> None:
    """A folder without ``__init__.py`` is not discovered and would not ship."""
    folders = {Path(m).parent for m in _runtime_modules(ROOT)}
    assert sorted(str(f) for f in folders
                  if not (ROOT / f.relative_to("kvsidecar") / "__init__.py").exists()) == []


def test_the_sdist_holds_what_builds_the_wheel(built: Built) -> None:
    with tarfile.open(built.sdist) as tar:
        top = built.sdist.name.removesuffix(".tar.gz")
        names = {n.removeprefix(top + "/") for n in tar.getnames()}
    needed = {m.removeprefix("kvsidecar/") for m in _runtime_modules(ROOT)}
    needed |= PACKAGE_DATA | BUILD_FILES | {"pyproject.toml", "README.md", "LICENSE"}
    assert sorted(needed - names) == []


def test_the_installed_package_is_the_wheel_not_the_checkout(built: Built) -> None:
    r = built.run("python", "-c", "import kvsidecar; print(kvsidecar.__file__)")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).is_relative_to(built.venv)
    assert f"kvsidecar-{kvsidecar.__version__}-" in built.wheel.name


def test_every_installed_module_imports(built: Built) -> None:
    """Every module imports with the wheel's declared dependencies only, but the
    vLLM adapter's modules that import vLLM (vLLM is not a dependency); its
    package, its layout and its memory pools import without vLLM."""
    code = ("import importlib, pkgutil, kvsidecar\n"
            "skipped = []\n"
            "for m in pkgutil.walk_packages(kvsidecar.__path__, 'kvsidecar.'):\n"
            "    if m.name == 'kvsidecar.__main__':\n"
            "        continue\n"
            "    try:\n"
            "        importlib.import_module(m.name)\n"
            "    except ModuleNotFoundError as e:\n"
            "        if not (m.name.startswith('kvsidecar.integrations.vllm.')\n"
            "                and (e.name or '').split('.')[0] == 'vllm'):\n"
            "            raise\n"
            "        skipped.append(m.name)\n"
            "print('imported')\n"
            "print(' '.join(skipped))\n")
    r = built.run("python", "-c", code)
    assert r.returncode == 0, r.stderr
    imported, _, skipped = r.stdout.partition("\n")
    assert imported == "imported"
    needs_vllm = set(skipped.split())
    assert "kvsidecar.integrations.vllm.connector" in needs_vllm  # no vLLM in this venv
    assert needs_vllm.isdisjoint({"kvsidecar.integrations.vllm.layout",
                                  "kvsidecar.integrations.vllm.pool",
                                  "kvsidecar.integrations.vllm.settings"}), needs_vllm


def test_demo_from_the_wheel(built: Built) -> None:
    r = built.run("kvsidecar", "demo", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "RESULT: OK, every byte matches the oracle" in r.stdout


def test_serve_help_from_the_wheel(built: Built) -> None:
    r = built.run("kvsidecar", "serve", "--help")
    assert r.returncode == 0, r.stderr
    assert "--peer-keys" in r.stdout


def test_version_from_the_wheel(built: Built) -> None:
    r = built.run("kvsidecar", "--version")
    assert (r.returncode, r.stdout.strip()) == (0, f"kvsidecar {kvsidecar.__version__}")


def test_keys_from_the_wheel(built: Built) -> None:
    keys = built.elsewhere / "keys"
    r = built.run("kvsidecar", "keys", str(keys))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(keys / "sidecar.key_secret")
    assert (keys / "sidecar.key_secret").stat().st_mode & 0o777 == 0o600
    assert (keys / "sidecar.key").exists()


def test_the_wheels_vllm_adapter_imports_next_to_vllm(built: Built,
                                                      tmp_path: Path) -> None:
    """vLLM is no dependency of the wheel: the test environment's vLLM imports the
    wheel's copy of the connector, ``kvsidecar.integrations.vllm`` (the only
    kvsidecar on the path)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
            pytest.fail("KVSIDECAR_REQUIRE_VLLM is set and vllm is not installed")
        pytest.skip("vllm is not installed (make test installs vllm==0.33.0)")
    site = next((built.venv / "lib").glob("python3*/site-packages"))
    only = tmp_path / "path"
    only.mkdir()
    (only / "kvsidecar").symlink_to(site / "kvsidecar")
    env = {**built.env, "PYTHONPATH": str(only)}
    code = ("import sys\n"
            "from kvsidecar.integrations.vllm import KvSidecarConnector as C\n"
            "print(sys.modules[C.__module__].__file__)\n")
    r = subprocess.run([sys.executable, "-c", code],
                       cwd=built.elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert Path(r.stdout.strip()).parent.parent.parent == only / "kvsidecar"


# ---- the image recipe: no container engine here (docs/operations.md), so
# the Containerfile is read, and its install steps are the ones run above.


def _instructions(stage_of: str = "") -> list[tuple[str, str, str]]:
    """(stage, INSTRUCTION, arguments) of the Containerfile, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Containerfile").read_text())
    out, stage = [], ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word == "FROM":
            stage = rest.split(" AS ")[-1] if " AS " in rest else ""
        out.append((stage, word, rest.strip()))
    return out


def test_the_image_builds_the_wheel_then_installs_only_it() -> None:
    ins = _instructions()
    froms = [(st, a) for st, w, a in ins if w == "FROM"]
    assert [st for st, _ in froms] == ["build", "runtime"]
    assert all(a.startswith("docker.io/library/python:${PYTHON}-slim AS ") for _, a in froms)
    runs = {st: [a for s2, w, a in ins if w == "RUN" and s2 == st] for st in ("build", "runtime")}
    assert f"python -m {' '.join(BUILD_WHEEL)} /dist ." in runs["build"]
    (install,) = runs["runtime"]
    steps = [step.strip() for step in install.split("&&")]
    assert steps[0] == "python -m pip install --no-cache-dir ${TORCH_SPEC}"
    assert steps[1].startswith('python -m pip install --no-cache-dir "$(ls /dist/kvsidecar-')
    assert "kvsidecar --version" in steps
    copies = [a for st, w, a in ins if w == "COPY" and st == "runtime"]
    assert copies == ["--from=build /dist /dist"]  # no source tree in the runtime stage


def test_the_image_runs_serve_as_a_user_and_stops_on_sigterm() -> None:
    final = [(w, a) for st, w, a in _instructions() if st == "runtime"]
    (user,) = [a for w, a in final if w == "USER"]
    assert user == "1000:1000"
    assert [a for w, a in final if w == "ENTRYPOINT"] == ['["kvsidecar", "serve"]']
    assert [a for w, a in final if w == "STOPSIGNAL"] == ["SIGTERM"]
    (health,) = [a for w, a in final if w == "HEALTHCHECK"]
    cmd = json.loads(health.split(" CMD ", 1)[1])
    assert cmd[:2] == ["kvsidecar", "status"]
    # the probe's flags are the CLI's: with no sidecar it answers 2, not a usage error
    from kvsidecar.cli import main

    assert main([*cmd[1:], "--socket", "/nonexistent/kvsidecar.sock"]) == 2


def test_the_image_is_labelled_with_this_version_and_its_source() -> None:
    final = [(w, a) for st, w, a in _instructions() if st == "runtime"]
    args = dict(a.split("=", 1) for w, a in final if w == "ARG" and "=" in a)
    assert args["VERSION"] == kvsidecar.__version__
    labels = " ".join(a for w, a in final if w == "LABEL")
    for key, value in (("version", "${VERSION}"), ("source", "${SOURCE}"),
                       ("revision", "${REVISION}"), ("licenses", "Apache-2.0")):
        assert f'org.opencontainers.image.{key}="{value}"' in labels


def test_the_kubernetes_pod_runs_this_version_of_the_image() -> None:
    import yaml

    docs = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/pod.yaml").read_text()))
    pod = next(d for d in docs if d and d.get("kind") == "Pod")
    (sc,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "kvsidecar"]
    assert sc["image"].endswith(f"/kvsidecar:{kvsidecar.__version__}")
    assert "serve" not in sc.get("args", [])  # the image's ENTRYPOINT says it


def test_the_image_build_context_leaves_out_what_git_ignores() -> None:
    """The build stage copies the checkout (``COPY . /src``): whatever git ignores
    (a venv, caches, the GPU check's ~60 MiB of wheels in .whl/) is no part of a
    clean clone and must not travel to the image builder either."""
    def entries(name: str) -> set[str]:
        lines = (ROOT / name).read_text().splitlines()
        return {line.strip().rstrip("/").removeprefix("**/") for line in lines
                if line.strip() and not line.startswith("#")}

    missing = entries(".gitignore") - entries(".dockerignore")
    assert not missing, f".dockerignore lacks what .gitignore ignores: {sorted(missing)}"
