"""The VRAM side of the transport self-check: what to expect from a GPU's facts
and how a seen path is judged (pure), the facts readable without a GPU, and the
host check still proving its path with the UCX version named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvsidecar.daemon.transport.check import run_check
from kvsidecar.daemon.transport.gpu_facts import (
    DeviceFacts,
    expected_vram_path,
    judge_vram,
    peermem_loaded,
    ucx_version,
)


def test_peermem_is_detected_like_ucx_does(tmp_path: Path) -> None:
    assert not peermem_loaded(str(tmp_path))
    (tmp_path / "sys/module/nvidia_peermem").mkdir(parents=True)
    (tmp_path / "sys/module/nvidia_peermem/version").write_text("1.0\n")
    assert peermem_loaded(str(tmp_path))


def test_ucx_version_of_the_loaded_library() -> None:
    import nixl._api  # noqa: F401  (loads NIXL's bundled libucp)

    assert re.fullmatch(r"\d+\.\d+\.\d+.*", ucx_version()), ucx_version()


def test_ucx_version_without_ucx(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 00:00 0 /usr/lib/libc.so.6\n")
    assert ucx_version(str(maps)) == ""


@pytest.mark.parametrize(("facts", "kw", "expected", "why"), [
    (DeviceFacts(nvlinks=None), {}, "cuda_ipc", "one node share memory"),
    (DeviceFacts(nvlinks=4), {}, "cuda_ipc", "one node share memory"),
    (DeviceFacts(nvlinks=0), {}, None, "no active NVLink"),
    (DeviceFacts(nvlinks=0), {"get_zcopy": "y"}, "cuda_ipc", "one node"),
    (DeviceFacts(ucx_version="1.21.0"), {"vmm": True}, None, "needs 1.22+"),
    (DeviceFacts(ucx_version="1.23.0"), {"vmm": True}, "cuda_ipc", "one node"),
    (DeviceFacts(dma_buf=True), {"same_node": False}, "rdma", "dma-buf"),
    (DeviceFacts(nvidia_peermem=True), {"same_node": False}, "rdma", "nvidia_peermem"),
    (DeviceFacts(), {"same_node": False}, None, "no GPUDirect RDMA"),
])
def test_expected_path(facts: DeviceFacts, kw: dict[str, object], expected: str | None,
                       why: str) -> None:
    got, reason = expected_vram_path(facts, **kw)  # type: ignore[arg-type]
    assert got == expected and why in reason


@pytest.mark.parametrize(("path", "expected", "mode", "passed", "says"), [
    ("cuda_ipc", "cuda_ipc", "require-zero-copy", True, "zero-copy cuda_ipc"),
    ("rdma", "rdma", "require-zero-copy", True, "zero-copy rdma"),
    ("tcp", "cuda_ipc", "require-zero-copy", False, "cuda_ipc was expected: UCX fell back"),
    ("cuda_copy", "cuda_ipc", "require-zero-copy", False, "software-staged copy"),
    ("cuda_copy", None, "require-zero-copy", False, "nothing zero-copy is possible"),
    ("tcp", "cuda_ipc", "allow-tcp", True, "allowed by --transport-check allow-tcp"),
    ("unknown", "cuda_ipc", "allow-tcp", False, "cannot tell"),
])
def test_judging_the_vram_path(path: str, expected: str | None, mode: str, passed: bool,
                               says: str) -> None:
    ok, detail = judge_vram(path, expected, mode)
    assert ok is passed and says in detail


async def test_host_check_names_the_ucx_version() -> None:
    r = await run_check("require-zero-copy", 4 << 20)
    assert r.passed and r.path in ("cma", "shm"), r
    assert re.search(r"\(UCX \d+\.\d+", r.detail), r.detail
