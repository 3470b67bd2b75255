"""Memory pools that place vLLM's KV-cache allocation where the sidecar reaches it.

vLLM's connector API lets a connector return ``get_mem_pool_context()``; the
worker allocates its whole KV cache inside it as one ``torch.zeros(n,
dtype=int8, device=...)`` (``vllm/v1/worker/utils.py``). Mooncake answers
with a ``torch.cuda.MemPool`` over a compiled pluggable allocator; this
module needs no compiled code: :class:`SidecarKVPool` is a
``TorchFunctionMode`` (the mechanism of ``with torch.device(...)``) that
serves exactly that one allocation as a zero-copy view of a region the
sidecar allocated and exported, and passes every other call through.

The sidecar must own the memory (it registers it with NIXL; imported GPU
memory cannot be re-exported), but vLLM learns its layout only from the
allocation, so the order is:

1. ``client.reserve(engine_id, nbytes, memory)``: a **fixed-size
   reservation**: the sidecar allocates ``nbytes`` (``memfd`` host memory,
   or ``cuda_malloc``/``cuda_vmm`` on its GPU) and the engine maps it;
2. ``with SidecarKVPool(region):`` vLLM allocates its KV cache, which must
   fit (a larger request raises :class:`ReservationTooSmall`, naming both
   sizes: vLLM sizes its cache from free memory, so pin it with
   ``--kv-cache-memory-bytes`` at or below the reservation);
3. :meth:`SidecarKVPool.views` turns the layout's ``(offset, nbytes)``
   regions into views, registered in attach mode (``ReservedRef``): the
   sidecar registers its own pointer plus offset.

The reservation lives until the engine deregisters (or the sidecar stops).

:class:`ShmKVPool` is the other placement (``memory`` ``shm``, CPU only): the
same one allocation, served from new POSIX shared memory this process creates,
which the sidecar maps when the engine registers it in attach mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
from torch.overrides import TorchFunctionMode

from ...ipc.memory import RegionError, ShmRegion, unique_name
from ...ipc.regions import Region, RegionView

__all__ = ["ReservationOnAnotherGpu", "ReservationTooSmall", "ShmKVPool", "SidecarKVPool"]


class ReservationTooSmall(RegionError):
    """The engine asked for more KV memory than the sidecar reserved."""


class ReservationOnAnotherGpu(RegionError):
    """The engine allocates its KV cache on another GPU than the sidecar's
    reservation lives on (the connector talks to another GPU's sidecar)."""


class _Tensorable(Protocol):
    def torch(self) -> torch.Tensor: ...


_DEVICE_OF = {"DRAM": "cpu", "VRAM": "cuda"}


class SidecarKVPool(TorchFunctionMode):
    """Serves the engine's one KV-cache allocation from ``region`` (zero-copy).

    ``region`` is what :meth:`SidecarClient.reserve` returned (host: memfd;
    GPU: a CUDA region). Only a 1-D ``torch.zeros``/``torch.empty`` of int8 or
    uint8 on the region's device type is taken, once, and with ``expect_bytes``
    (vLLM's connector knows it: the ``KVCacheTensor`` size) only one of exactly
    that size. The memory a sidecar allocates is zero already (memfd pages,
    ``cuMemsetD8``), so ``zeros`` holds.
    """

    def __init__(self, region: Region, expect_bytes: int | None = None) -> None:
        super().__init__()
        self.region = region
        self.expect_bytes = expect_bytes
        self.device_type = _DEVICE_OF[region.mem_type]
        self.tensor: torch.Tensor | None = None

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if (func in (torch.zeros, torch.empty) and self.tensor is None
                and self._is_kv_buffer(args, kwargs)):
            n = _size(args, kwargs)
            self._check_gpu(kwargs.get("device"))
            if n > self.region.nbytes:
                raise ReservationTooSmall(
                    f"the engine allocates {n} B of KV cache but the sidecar reservation is "
                    f"{self.region.nbytes} B: reserve more, or cap the engine's KV cache "
                    "(vLLM: --kv-cache-memory-bytes)")
            whole = cast(_Tensorable, self.region).torch()
            self.tensor = whole[:n].view(kwargs.get("dtype", torch.int8))
            return self.tensor
        return func(*args, **kwargs)

    def _check_gpu(self, device: Any) -> None:
        """A GPU reservation serves only an allocation on its own GPU (the
        requested index, or the thread's current device): any other is refused
        with both named, never served from memory on another GPU."""
        if self.device_type != "cuda":
            return
        index = torch.device(device).index
        if index is None:
            index = torch.cuda.current_device()
        if index != self.region.device.index:
            raise ReservationOnAnotherGpu(
                f"the engine allocates its KV cache on cuda:{index} but the sidecar "
                f"reservation is on cuda:{self.region.device.index} "
                f"({self.region.device.uuid}): point the connector at the sidecar of this "
                "worker's GPU (kv_connector_extra_config sidecar_socket)")

    def _is_kv_buffer(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        n = _size(args, kwargs)
        if n < 0 or kwargs.get("dtype") not in (torch.int8, torch.uint8):
            return False
        if self.expect_bytes is not None and n != self.expect_bytes:
            return False
        device = kwargs.get("device")
        kind = torch.device(device).type if device is not None else "cpu"
        return kind == self.device_type

    def views(self, regions: Sequence[tuple[int, int]]) -> list[Region]:
        """``(offset, nbytes)`` regions of the layout, as views to register (attach
        mode). Offsets are into the engine's KV buffer, which starts at the
        reservation's first byte."""
        if self.tensor is None:
            raise RegionError("the engine's KV cache was not allocated inside this pool")
        return [RegionView(self.region, off, n) for off, n in regions]


def _size(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The element count of a 1-D size argument; -1 for anything else."""
    size = args[0] if len(args) == 1 else (tuple(args) if args else kwargs.get("size"))
    if isinstance(size, (tuple, list, torch.Size)):
        if len(size) != 1:
            return -1
        size = size[0]
    return int(size) if isinstance(size, int) and size > 0 else -1


class ShmKVPool(TorchFunctionMode):
    """vLLM's one KV allocation (``torch.zeros(n, dtype=int8)``) placed in new
    POSIX shared memory, so the sidecar can map the same pages.

    A TorchFunctionMode (the mechanism behind ``with torch.device(...)``)
    sees every torch call in the ``with`` block and serves exactly the
    expected-size int8 CPU allocation; everything else passes through.
    """

    def __init__(self, nbytes: int, prefix: str) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.prefix = prefix
        self.region: ShmRegion | None = None

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and self.region is None and self._is_kv_buffer(args, kwargs):
            self.region = ShmRegion.create(unique_name(self.prefix), self.nbytes)
            return self.region.torch().view(torch.int8)  # fresh shm reads as zeros
        return func(*args, **kwargs)

    def _is_kv_buffer(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        size = args[0] if len(args) == 1 else (tuple(args) if args else kwargs.get("size"))
        if isinstance(size, (tuple, list)) and len(size) == 1:
            size = size[0]
        device = kwargs.get("device")
        return (size == self.nbytes and kwargs.get("dtype") == torch.int8
                and (device is None or torch.device(device).type == "cpu"))
