"""The suite's tiers are its folders, and each folder is its marker.

- ``tests/unit``: pure logic, fake NIXL agents; no processes, no real NIXL.
  ``make test-fast`` runs this tier alone, without vLLM installed.
- ``tests/integration``: real pieces inside the test process (NIXL agents,
  Unix sockets, ZMQ, memfds, an in-process sidecar), helper processes at most.
- ``tests/e2e``: real ``kvsidecar serve`` processes, the wheel, the scripts.
- ``tests/vllm_connector``: the vLLM adapter through vLLM's real scheduler.

A test is marked with its folder's tier (``-m unit`` selects the folder); a
tier marker written on a test in another folder is a collection error, so
markers cannot drift from where a test lives.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TIERS = {"unit": "unit", "integration": "integration", "e2e": "e2e", "vllm_connector": "vllm"}


def tier_of(path: Path) -> str:
    rel = path.resolve().relative_to(HERE)
    if len(rel.parts) < 2 or rel.parts[0] not in TIERS:
        raise pytest.UsageError(f"{rel}: a test module lives in one of {sorted(TIERS)}")
    return TIERS[rel.parts[0]]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(Path(str(item.path)))
        written = {m.name for m in item.iter_markers()} & (set(TIERS.values()) - {tier})
        if written:
            raise pytest.UsageError(
                f"{item.nodeid}: marked {sorted(written)} but lives in the {tier} tier")
        item.add_marker(tier)
