"""How the sidecar obtains each kind of region: one table to allocate, one to attach.

Allocate mode looks the requested ``Register.memory`` up in
:data:`ALLOCATORS`; attach mode looks each reference's type up in
:data:`ATTACHERS`. GPU kinds need the sidecar's device
(:class:`Gpu`, ``--device cuda:N``): a
sidecar without one refuses them with a reason that names what it serves,
before anything is allocated.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from kvsidecar.daemon import host_memory
from kvsidecar.ipc.layout import Layout
from kvsidecar.ipc.memfd import MemfdRegion
from kvsidecar.ipc.memory import (
    ENGINE_SHM_PREFIX,
    RegionError,
    ShmRegion,
    unique_name,
)
from kvsidecar.ipc.protocol import (
    BAD_REQUEST,
    UNAVAILABLE,
    CudaIpcRef,
    CudaVmmRef,
    MemfdRef,
    RegionRef,
    RequestError,
    ReservedRef,
    ShmRef,
)
from kvsidecar.ipc.regions import Device, Region, RegionView


class Gpu(Protocol):
    """The sidecar's GPU as the tables use it (``kvsidecar.daemon.cuda_device``)."""

    @property
    def device(self) -> Device: ...

    def allocate(self, kind: str, count: int, nbytes: int) -> list[Region]:
        """``count`` regions of ``kind`` (cuda_malloc, cuda_vmm), exported."""

    def attach_ipc(self, refs: Sequence[CudaIpcRef], owner_uid: int | None) -> list[Region]:
        """Open engine-allocated regions (legacy IPC handles) as the policy allows."""

__all__ = ["ALLOCATORS", "ATTACHERS", "HOST_KINDS", "MemoryContext", "allocate", "attach",
           "refusal"]


@dataclass(frozen=True)
class MemoryContext:
    """What an allocator or attacher may use: this sidecar's naming prefix, the
    registering engine's uid (attach mode maps only what it owns) and the GPU
    (None on a host-only sidecar)."""

    engine_id: str
    shm_prefix: str = "kvs"
    owner_uid: int | None = None
    gpu: Gpu | None = None
    #: the allocation this engine made with ``Reserve`` (``reserved`` views map into it)
    reserved: Region | None = None
    #: serve POSIX shm at all (``--allow-unsealed-shm``): see :func:`_unsealed_refusal`
    allow_unsealed_shm: bool = False


Allocator = Callable[[int, int, MemoryContext], list[Region]]
"""(count, nbytes, context) -> ``count`` regions of ``nbytes``, all or none."""
Attacher = Callable[[Sequence[RegionRef], Layout, MemoryContext], list[Region]]

#: Kinds every sidecar serves.
HOST_KINDS: Final = ("shm", "memfd")


def refusal(kind: str, ctx: MemoryContext) -> str:
    """Why this sidecar cannot serve ``kind`` (a GPU kind without a GPU)."""
    serves = ", ".join(HOST_KINDS + (("cuda_malloc", "cuda_vmm", "cuda_ipc")
                                     if ctx.gpu is not None else ()))
    return (f"memory kind {kind!r} needs a GPU sidecar (--device cuda:N with cuda-bindings "
            f"installed: pip install 'kvsidecar[gpu]'); this sidecar serves {serves}")


def _check_unsealed(ctx: MemoryContext) -> None:
    """Refuse POSIX shm unless the operator allowed it: a memfd's size can be sealed,
    a shm object's cannot, and an engine that truncates memory this sidecar maps
    kills it with SIGBUS the next time a peer reads those pages (every engine on
    the sidecar with it). Nothing at user level can catch that fault in NIXL's
    threads, so the only safe answer is not to map such memory."""
    if not ctx.allow_unsealed_shm:
        raise RequestError(BAD_REQUEST, "POSIX shared memory (memory='shm', or attach mode) "
                                        "cannot be sealed against truncation, which would "
                                        "kill this sidecar; use memory='memfd' (allocate mode, "
                                        "the default), or start the sidecar with "
                                        "--allow-unsealed-shm if every engine is trusted; "
                                        "an engine client from before sealed memfds "
                                        "(protocol minor 10 or older) asks for 'shm' by "
                                        "default: that version skew is refused, upgrade it "
                                        "(docs/operations.md, Rolling upgrades)")


def _prefix(ctx: MemoryContext) -> str:
    return f"{ctx.shm_prefix}-" + re.sub(r"[^A-Za-z0-9_.-]", "_", ctx.engine_id)[:40]


def _all_or_none(count: int, make: Callable[[int], Region], *, created: bool) -> list[Region]:
    """``make(i)`` for each i < count. On any failure every region made so far is
    closed (and unlinked when this sidecar created it), so a refused request
    leaves no mapping or shared-memory object behind."""
    out: list[Region] = []
    try:
        for i in range(count):
            out.append(make(i))
    except BaseException:
        for r in out:
            r.close()
            if created:
                r.unlink()
        raise
    return out


def _allocate_host(create: Callable[[str, int, int | None], Region], *,
                   sealed: bool) -> Allocator:
    """``create(name, nbytes, engine uid)`` each region, booked in the host-memory
    ledger; unsealable kinds only with ``--allow-unsealed-shm``."""
    def alloc(count: int, nbytes: int, ctx: MemoryContext) -> list[Region]:
        if not sealed:
            _check_unsealed(ctx)
        try:  # booked before anything is reserved (see daemon/host_memory.py)
            with host_memory.LEDGER.claim(count * nbytes):
                return _all_or_none(
                    count, lambda _: create(unique_name(_prefix(ctx)), nbytes, ctx.owner_uid),
                    created=True)
        except host_memory.HostMemoryError as e:
            raise RequestError(UNAVAILABLE, str(e)) from None
    return alloc


def _allocate_cuda(kind: str) -> Allocator:
    def alloc(count: int, nbytes: int, ctx: MemoryContext) -> list[Region]:
        if ctx.gpu is None:
            raise RequestError(BAD_REQUEST, refusal(kind, ctx))
        return ctx.gpu.allocate(kind, count, nbytes)
    return alloc


def _attach_shm(refs: Sequence[RegionRef], layout: Layout, ctx: MemoryContext) -> list[Region]:
    _check_unsealed(ctx)
    def attach(i: int) -> Region:
        ref = refs[i]
        assert isinstance(ref, ShmRef)  # the table routed it here by type
        if not ref.name.startswith(ENGINE_SHM_PREFIX):
            raise RequestError(
                BAD_REQUEST,
                f"region {i}: attach mode maps only shared memory named "
                f"{ENGINE_SHM_PREFIX}..., got {ref.name[:80]!r}")
        return ShmRegion.attach(ref.name, ref.nbytes, offset=ref.offset,
                                owner_uid=ctx.owner_uid)
    return _all_or_none(len(refs), attach, created=False)  # the engine owns its objects


def _attach_cuda_ipc(refs: Sequence[RegionRef], layout: Layout,
                     ctx: MemoryContext) -> list[Region]:
    if ctx.gpu is None:
        raise RequestError(BAD_REQUEST, refusal("cuda_ipc", ctx))
    ipc = [r for r in refs if isinstance(r, CudaIpcRef)]
    return ctx.gpu.attach_ipc(ipc, ctx.owner_uid)


def _attach_reserved(refs: Sequence[RegionRef], layout: Layout,
                     ctx: MemoryContext) -> list[Region]:
    parent = ctx.reserved
    if parent is None:
        raise RequestError(BAD_REQUEST, f"engine {ctx.engine_id[:200]!r} has no reservation "
                                        "here (send Reserve first, from the same user)")
    out: list[Region] = []
    for i, ref in enumerate(refs):
        assert isinstance(ref, ReservedRef)
        if ref.offset + ref.nbytes > parent.nbytes:
            raise RequestError(BAD_REQUEST, f"region {i} ({ref.nbytes} B at {ref.offset}) ends "
                                            f"past the {parent.nbytes} B reservation")
        out.append(RegionView(parent, ref.offset, ref.nbytes))
    return out


def _not_attachable(kind: str) -> Attacher:
    def refuse(refs: Sequence[RegionRef], layout: Layout, ctx: MemoryContext) -> list[Region]:
        raise RequestError(BAD_REQUEST, f"attach mode cannot take {kind!r} regions: they are "
                                        "the sidecar's own exports (use allocate mode)")
    return refuse


ALLOCATORS: Final[dict[str, Allocator]] = {
    # A segment is given to the engine's uid (another allowed user could not open
    # a 0600 one of the sidecar's); a memfd travels as an fd, to that uid only.
    "shm": _allocate_host(lambda name, n, uid: ShmRegion.create(name, n, owner_uid=uid),
                          sealed=False),
    "memfd": _allocate_host(lambda name, n, uid: MemfdRegion.create(name, n, owner_uid=uid),
                            sealed=True),
    "cuda_malloc": _allocate_cuda("cuda_malloc"),
    "cuda_vmm": _allocate_cuda("cuda_vmm"),
}

ATTACHERS: Final[dict[type[RegionRef], Attacher]] = {
    ShmRef: _attach_shm,
    CudaIpcRef: _attach_cuda_ipc,
    ReservedRef: _attach_reserved,
    MemfdRef: _not_attachable("memfd"),
    CudaVmmRef: _not_attachable("cuda_vmm"),
}


def allocate(kind: str, count: int, nbytes: int, ctx: MemoryContext) -> list[Region]:
    """Allocate ``count`` regions of ``nbytes`` of ``kind`` (all or none)."""
    alloc = ALLOCATORS.get(kind)
    if alloc is None:
        raise RequestError(BAD_REQUEST, f"unknown memory kind {kind!r} "
                                        f"(known: {', '.join(ALLOCATORS)})")
    try:
        return alloc(count, nbytes, ctx)
    except (RegionError, OSError) as e:
        raise RequestError(BAD_REQUEST, f"cannot allocate {count} {kind} regions "
                                        f"of {nbytes} B: {e}") from None


def attach(refs: Sequence[RegionRef], layout: Layout, ctx: MemoryContext) -> list[Region]:
    """Map the engine's regions, all of one kind, each exactly one layout region."""
    kinds = {type(r) for r in refs}
    if len(kinds) != 1:
        tags = sorted(str(k.__struct_config__.tag) for k in kinds)
        raise RequestError(BAD_REQUEST, "attach mode needs the regions of one rank to be of one "
                                        f"kind, got {tags}")
    need = layout.region_bytes
    for i, ref in enumerate(refs):
        if ref.nbytes != need:
            raise RequestError(
                BAD_REQUEST,
                f"region {i} is {ref.nbytes} B; the layout needs exactly {layout.num_blocks} "
                f"pages x {layout.page_bytes} B = {need} B")
    try:
        return ATTACHERS[kinds.pop()](refs, layout, ctx)
    except (RegionError, OSError) as e:
        raise RequestError(BAD_REQUEST, f"cannot map the engine's regions: {e}") from None
