"""What a GPU sidecar should expect from UCX, and whether what it saw is good enough.

The VRAM self-check (``check.py``, ``KVSIDECAR_CHECK_DEVICE``) reads UCX's
protocol table for a loopback READ between two VRAM buffers, like the host
check. A table is not enough on its own: UCX silently falls back to staged
(``cuda_copy`` through host memory) or TCP paths when a zero-copy one is not
usable (imported memory it cannot re-export; VMM without ``pidfd_getfd``
permission; no NVLink for GET zero-copy), so the check also gathers the
device's facts and decides what it *should* have seen:

* the same GPU (loopback), or GPUs on one node: ``cuda_ipc``;
* across nodes: ``rdma`` when GPUDirect RDMA is possible (dma-buf support,
  or the ``nvidia_peermem`` module), else nothing zero-copy is expected.

:func:`judge_vram` fails readiness when zero-copy was expected and a staged
or TCP path was seen, unless the operator allowed slower paths
(``--transport-check allow-tcp``). Pure functions, tested on any machine;
:func:`gather` needs a GPU.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["DeviceFacts", "expected_vram_path", "gather", "judge_vram", "peermem_loaded",
           "ucx_version"]

#: paths that move GPU bytes without staging them through host memory or a socket
VRAM_ZERO_COPY = frozenset({"cuda_ipc", "rdma", "self"})
_PEERMEM = ("/sys/kernel/mm/memory_peers/nv_mem/version", "/sys/module/nvidia_peermem/version",
            "/sys/module/nv_peer_mem/version")


@dataclass(frozen=True)
class DeviceFacts:
    """The device attributes and host facts that decide the GPU data path."""

    uuid: str = ""
    dma_buf: bool = False  # CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
    gpudirect_rdma: bool = False  # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED
    vmm_rdma: bool = False  # ..._GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
    vmm: bool = False  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    posix_fd_handles: bool = False  # ..._HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
    fabric_handles: bool = False  # ..._HANDLE_TYPE_FABRIC_SUPPORTED
    nvidia_peermem: bool = False
    nvlinks: int | None = None  # active NVLinks (None: NVML not available)
    ucx_version: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def peermem_loaded(root: str = "/") -> bool:
    """UCX's own test for the GPUDirect peer-memory module: one of its files exists."""
    return any(os.path.exists(os.path.join(root, p.lstrip("/"))) for p in _PEERMEM)


def ucx_version(maps: str = "/proc/self/maps") -> str:
    """The version of the libucp loaded in this process, else of the one NIXL's
    wheel ships (NIXL loads UCX only when its first UCX backend is created),
    from ``ucp_get_version_string``; '' when none is found. ctypes because no
    Python binding exposes it, and the library is whichever NIXL uses."""
    try:
        with open(maps) as f:
            paths = sorted({line.split()[-1] for line in f if "libucp" in line and "/" in line})
    except OSError:
        paths = []
    if not paths and maps == "/proc/self/maps":
        paths = _bundled_libucp()
    for path in paths:
        try:
            fn = ctypes.CDLL(path).ucp_get_version_string
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_char_p
        got = fn()
        return got.decode() if isinstance(got, bytes) else ""
    return ""


def _bundled_libucp() -> list[str]:
    import importlib.util

    spec = importlib.util.find_spec("nixl")
    if spec is None or not spec.submodule_search_locations:
        return []
    site = Path(next(iter(spec.submodule_search_locations))).parent
    return sorted(str(p) for p in site.glob("nixl*.libs/libucp-*.so*"))


def _version(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def expected_vram_path(facts: DeviceFacts, *, same_node: bool = True, vmm: bool = False,
                       get_zcopy: str = "auto") -> tuple[str | None, str]:
    """The zero-copy path a READ of this GPU's memory should take, or None when
    none can be expected here; with the reason. ``get_zcopy`` is
    ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` (UCX turns cuda_ipc GETs, which READs
    are, off by default when it finds no NVLink)."""
    if same_node:
        if facts.nvlinks == 0 and get_zcopy.lower() not in ("y", "yes", "on", "1"):
            return None, ("no active NVLink: UCX disables cuda_ipc GET zero-copy "
                          "(UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto); set it to y to expect it")
        if vmm and facts.ucx_version and _version(facts.ucx_version) < (1, 22):
            return None, (f"UCX {facts.ucx_version} has no cuda_ipc for POSIX-fd VMM memory "
                          "(needs 1.22+): use cuda_malloc regions")
        return "cuda_ipc", "GPUs on one node share memory through cuda_ipc"
    if facts.dma_buf or facts.nvidia_peermem:
        how = "dma-buf" if facts.dma_buf else "nvidia_peermem"
        return "rdma", f"GPUDirect RDMA is available ({how})"
    return None, "no GPUDirect RDMA here (no dma-buf support, no nvidia_peermem)"


def judge_vram(path: str, expected: str | None, mode: str) -> tuple[bool, str]:
    """Does the path seen pass? Fails when zero-copy was expected and a staged
    (cuda_copy) or TCP path was seen, unless slower paths are allowed."""
    if path in VRAM_ZERO_COPY:
        return True, f"GPU-memory READs take the zero-copy {path} path"
    slow = {"tcp": "TCP", "cuda_copy": "a software-staged copy through host memory"}.get(path)
    if slow is None:
        return False, f"cannot tell which path GPU-memory READs take ({path})"
    if mode == "allow-tcp":
        return True, f"GPU-memory READs go over {slow} (allowed by --transport-check allow-tcp)"
    if expected is None:
        return False, (f"GPU-memory READs go over {slow} and nothing zero-copy is possible "
                       "here; pass --transport-check allow-tcp to accept it")
    return False, (f"GPU-memory READs go over {slow}, but {expected} was expected: UCX fell "
                   "back silently (check UCX_TLS includes cuda_ipc, that the memory is the "
                   "sidecar's own, and for VMM that peers may pidfd_getfd the sidecar); pass "
                   "--transport-check allow-tcp to accept it")


def gather(ordinal: int) -> DeviceFacts:
    """Read the facts of GPU ``ordinal`` (needs a GPU and the gpu extra)."""
    from kvsidecar.ipc import cuda

    drv = cuda.driver()
    dev = cuda.check(drv.cuDeviceGet(ordinal), "cuDeviceGet")

    def attr(name: str) -> bool:
        a = getattr(drv.CUdevice_attribute, name)
        return bool(cuda.check(drv.cuDeviceGetAttribute(a, dev), name))

    return DeviceFacts(
        uuid=cuda.device_uuid(ordinal),
        dma_buf=attr("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED"),
        gpudirect_rdma=attr("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED"),
        vmm_rdma=attr("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"),
        vmm=attr("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"),
        posix_fd_handles=attr("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"),
        fabric_handles=attr("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"),
        nvidia_peermem=peermem_loaded(),
        nvlinks=_nvlinks(ordinal),
        ucx_version=ucx_version(),
    )


def _nvlinks(ordinal: int) -> int | None:
    """Active NVLinks of the GPU through NVML (cuda.bindings.nvml); None if unknown.

    NVML numbers GPUs its own way; with CUDA_VISIBLE_DEVICES narrowing the set
    the ordinal may differ, so this is a hint for the log, never a gate."""
    try:
        from cuda.bindings import nvml
    except ImportError:
        return None
    try:
        nv: Any = nvml
        nv.init_v2()
        handle = nv.device_get_handle_by_index_v2(ordinal)
        links = 0
        for link in range(18):  # NVML_NVLINK_MAX_LINKS
            try:
                links += int(nv.device_get_nvlink_state(handle, link) == 1)
            except Exception:
                break
        return links
    except Exception:
        return None
