"""The README is a front door and the documents point at things that exist.

- README.md stays at most 300 lines (the manual lives in docs/).
- Every relative link in README.md and docs/*.md resolves, from the file's
  own folder (anchors and web addresses aside).
- Every source path in backticks in docs/*.md (``daemon/x.py``,
  ``tests/e2e/test_y.py::test_z``) names a file that exists, and a test it
  names exists in that file.
- The documented vLLM config names the socket of the ``kvsidecar serve`` it
  pairs with, and the README example's fallback is serve's default socket.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

LINK = re.compile(r"\]\(([^)\s]+)\)")
SOURCE_PATH = re.compile(r"`([\w.-]+(?:/[\w.@-]+)*/[\w.-]+\.py)(?:::\s*([\w]+))?")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _relative_links(text: str) -> list[str]:
    out = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith(("mailto:", "#")):
            continue
        out.append(target.split("#", 1)[0])
    return out


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move detail into docs/"


def test_the_documents_exist() -> None:
    assert {"security.md", "failure-handling.md", "gpu.md", "operations.md", "metrics.md",
            "protocol.md", "vllm.md", "planner.md", "testing.md",
            "performance.md", "configuration.md"} <= {d.name for d in DOCS}


@pytest.mark.parametrize("doc", [README, *DOCS], ids=_name)
def test_relative_links_resolve(doc: Path) -> None:
    missing = [t for t in _relative_links(doc.read_text())
               if not (doc.parent / t).exists()]
    assert missing == [], f"{_name(doc)} links to missing files: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_source_paths_in_docs_exist(doc: Path) -> None:
    bad = []
    for path, test in SOURCE_PATH.findall(doc.read_text()):
        file = ROOT / path.removeprefix("kvsidecar/")
        if not file.is_file():
            bad.append(path)
        elif test and not re.search(rf"\bdef {test}\b", file.read_text()):
            bad.append(f"{path}::{test}")
    assert bad == [], f"{_name(doc)} names what does not exist: {bad}"


def test_the_checks_catch_what_they_look_for() -> None:
    """The patterns find a link and a path (a check that finds nothing cannot fail)."""
    assert _relative_links("[a](docs/x.md#y) [b](https://e.org) [c](#z)") == ["docs/x.md"]
    assert SOURCE_PATH.findall("`daemon/x.py` `tests/e2e/t.py::test_a` `x.py`") == [
        ("daemon/x.py", ""), ("tests/e2e/t.py", "test_a")]


def test_architecture_names_every_module() -> None:
    """docs/ARCHITECTURE.md is the map: every module of the package is on it
    (by file name), so a new room is placed on the map when it is built."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = sorted(
        str(p.relative_to(ROOT))
        for pkg in ("ipc", "daemon", "metrics", "integrations", "sim")
        for p in (ROOT / pkg).rglob("*.py")
        if p.name != "__init__.py" and f"`{p.name}`" not in text
        and f"`{p.parent.name}/{p.name}`" not in text
        and str(p.relative_to(ROOT)) not in text)
    assert missing == [], f"docs/ARCHITECTURE.md does not place: {missing}"


BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


@pytest.mark.parametrize("doc", [README, ROOT / "docs" / "vllm.md"], ids=_name)
def test_a_documented_vllm_config_meets_the_serve_it_pairs_with(doc: Path) -> None:
    """The documented kv-transfer-config once named /tmp/kvsidecar/cpu.sock, where no
    ``kvsidecar serve`` listens (its default is /tmp/kvsidecar-<uid>/...): each
    block's ``sidecar_socket`` (rank 0) is the ``--socket`` of the serve it shows."""
    blocks = [body for _, body in BLOCK.findall(doc.read_text())
              if '"kv_connector": "KvSidecarConnector"' in body]
    assert blocks, doc
    for body in blocks:
        named = re.search(r'"sidecar_socket": "([^"]+)"', body)
        assert named is not None, body
        served = re.findall(r"kvsidecar serve .*?--socket (\S+)", body)
        assert named.group(1).format(rank=0, local_rank=0) in served, body


def test_the_readme_example_falls_back_to_serves_default_socket() -> None:
    code = "".join(body for lang, body in BLOCK.findall(README.read_text())
                   if lang == "python")
    assert 'os.environ.get("KVSIDECAR_SOCKET") or default_socket("cpu")' in code
    for doc in [README, *DOCS]:
        assert "/tmp/kvsidecar/" not in doc.read_text(), doc  # a socket serve never makes
