"""The READY line docs/operations.md documents is the one ``kvsidecar serve``
prints: the same keys, and a handshake address of the documented shape
(``host:port/<public key in hex>``, the key only with peer keys)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.sim.cluster import SidecarProcess

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"


def _documented() -> dict[str, Any]:
    line = re.search(r"^\s*KVSIDECAR READY (\{.*\})$", OPERATIONS.read_text(), re.M)
    assert line is not None, "docs/operations.md shows no whole READY line"
    documented: dict[str, Any] = json.loads(line.group(1))
    return documented


def test_the_documented_ready_line_is_json_with_a_keyed_handshake() -> None:
    doc = _documented()
    assert re.fullmatch(r"[\w.]+:\d+/[0-9a-f]{64}", doc["handshake"]), doc["handshake"]


@pytest.mark.e2e
@pytest.mark.parametrize("args", [[], ["--insecure-peers"]], ids=["peer keys", "insecure"])
def test_the_ready_line_has_the_documented_keys(tmp_path: Path, args: list[str]) -> None:
    sidecar = SidecarProcess(tmp_path, "ready", args=args).start()
    try:
        ready = sidecar.ready
    finally:
        assert sidecar.stop() == 0, sidecar.read_log()
    assert sorted(ready) == sorted(_documented()), ready
    assert ready["socket"] == sidecar.socket and ready["socket"].startswith("/")
    if args:
        assert ready["peer_auth"] == "none"
        assert re.fullmatch(r"127\.0\.0\.1:\d+", ready["handshake"]), ready
    else:
        assert ready["peer_auth"] == "curve"
        assert re.fullmatch(r"127\.0\.0\.1:\d+/[0-9a-f]{64}", ready["handshake"]), ready
