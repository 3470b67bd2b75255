"""Pure helpers for GPU regions: device names, IPC handle bytes, attach decisions.

No CUDA here (tested on any machine): the driver calls live in
:mod:`kvsidecar.ipc.cuda` (engine side) and ``kvsidecar.daemon.cuda_device``
(sidecar side), which use these to build and check what crosses processes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from .protocol import CUDA_IPC_HANDLE_BYTES, CudaIpcRef

__all__ = ["ATTACH_POLICIES", "AttachDecision", "AttachPolicy", "attach_policy",
           "check_ipc_handle",
           "decide_attach", "parse_cuda_device", "uuid_from_bytes", "vmm_alloc_bytes"]

_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_DEVICE = re.compile(r"^cuda:(\d{1,3})$")


def uuid_from_bytes(raw: bytes) -> str:
    """``CUuuid.bytes`` (16 bytes) -> ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``,
    the form ``nvidia-smi -L`` prints and ``CUDA_VISIBLE_DEVICES`` accepts."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID is 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def is_gpu_uuid(text: str) -> bool:
    return bool(_UUID.match(text))


def parse_cuda_device(device: str) -> int | None:
    """``cuda:N`` -> N; ``cpu`` -> None; anything else is a ValueError."""
    if device == "cpu":
        return None
    m = _DEVICE.match(device)
    if m is None:
        raise ValueError(f"device must be cpu or cuda:N, got {device!r}")
    return int(m.group(1))


def check_ipc_handle(handle: bytes) -> bytes:
    """A legacy CUDA IPC handle is exactly 64 opaque bytes; all zeros is no handle."""
    if len(handle) != CUDA_IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle is {CUDA_IPC_HANDLE_BYTES} bytes, "
                         f"got {len(handle)}")
    if not any(handle):
        raise ValueError("the CUDA IPC handle is all zeros (not exported)")
    return bytes(handle)


def vmm_alloc_bytes(nbytes: int, granularity: int) -> int:
    """``nbytes`` rounded up to the VMM allocation granularity (cuMemCreate's rule)."""
    if nbytes < 1 or granularity < 1:
        raise ValueError(f"need nbytes >= 1 and granularity >= 1, got {nbytes}, {granularity}")
    return -(-nbytes // granularity) * granularity


# -- engine-allocated GPU memory (attach mode) --------------------------------------------------

AttachPolicy: TypeAlias = Literal["serve", "warn", "refuse"]
ATTACH_POLICIES: Final[tuple[AttachPolicy, ...]] = ("serve", "warn", "refuse")


def attach_policy(value: str) -> AttachPolicy:
    """A ``--cuda-attach`` value, checked."""
    for p in ATTACH_POLICIES:
        if p == value:
            return p
    raise ValueError(f"--cuda-attach must be one of {', '.join(ATTACH_POLICIES)}, got {value!r}")


@dataclass(frozen=True)
class AttachDecision:
    """Whether engine-allocated GPU memory is registered, and what to say."""

    serve: bool
    message: str


def decide_attach(policy: AttachPolicy, vram_check_passed: bool | None,
                  refs: list[CudaIpcRef], sidecar_uuid: str) -> AttachDecision:
    """Whether to register GPU memory that the engine allocated and the sidecar
    can only *import* (``cuIpcOpenMemHandle``).

    Why this is not simply served: CUDA documents no way to re-export imported
    memory, and UCX's cuda_ipc/dma-buf paths need exactly that; where they
    fail UCX silently falls back to a staged or TCP path (a reported case ran
    at 0.4 GB/s instead of ~100). So: ``refuse`` always refuses; ``serve``
    serves; ``warn`` (the default) serves with a loud warning unless the
    start-up VRAM transport check showed that the zero-copy path is not
    there (``vram_check_passed`` False), and then refuses. Regions on another
    GPU than the sidecar's are refused under every policy.
    """
    for i, ref in enumerate(refs):
        if ref.device_uuid != sidecar_uuid:
            return AttachDecision(False, f"region {i} is on GPU {ref.device_uuid}; this sidecar "
                                         f"serves GPU {sidecar_uuid} (one sidecar per GPU)")
    use_allocate = ("register with allocate=True and memory='cuda_malloc' or 'cuda_vmm' so "
                    "the sidecar owns and exports the memory")
    if policy == "refuse":
        return AttachDecision(False, "this sidecar does not register engine-allocated GPU "
                                     f"memory (--cuda-attach refuse); {use_allocate}")
    if policy == "serve":
        return AttachDecision(True, "serving engine-allocated GPU memory (--cuda-attach serve)")
    if vram_check_passed is False:
        return AttachDecision(False, "the start-up VRAM transport check did not see a zero-copy "
                                     "path, and imported GPU memory would fall back to a "
                                     f"slower one silently; {use_allocate} (or pass "
                                     "--cuda-attach serve to accept it)")
    return AttachDecision(True, "serving engine-allocated GPU memory: CUDA does not document "
                                "re-exporting imported memory, so UCX may take a staged or TCP "
                                f"path for it without an error; {use_allocate}")
