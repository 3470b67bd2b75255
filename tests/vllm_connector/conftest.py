"""Sidecars and model configs shared by every module of this package (two P
and two D sidecars, started once): each test builds its own engines under
names of its own, so requests of one test never meet another's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="package")
def sidecars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from .test_connector import Sidecars, start_all

    s = Sidecars(tmp_path_factory.mktemp("vllm-scenario-sidecars"))
    try:
        start_all(s.all)
        yield s
    finally:
        for sc in s.all:
            sc.stop()


@pytest.fixture(scope="package")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, str]:
    from .harness import write_model

    d = tmp_path_factory.mktemp("scenario-models")
    return {False: write_model(d / "llama", False), True: write_model(d / "hybrid", True)}
