"""An engine rank's memory: map or create its regions, release them, find leftovers.

Memory comes in both ownership directions: *attach* maps regions the engine
created; *allocate* creates them here and hands references back (the
direction GPU memory needs, since memory belongs to the process that
registers it). Either way the sizes are checked against the layout before
NIXL sees an address. Also here: touching a host rank's pages ahead of its
first reads (:func:`prefault_rank`) and its staging pool
(:func:`attach_staging`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from functools import partial

from kvsidecar.daemon import memory_kinds
from kvsidecar.daemon.engines.rank import EngineRank
from kvsidecar.daemon.memory_kinds import Gpu, MemoryContext
from kvsidecar.daemon.prefault import prefault
from kvsidecar.daemon.staging import StagingPool
from kvsidecar.ipc.layout import Layout
from kvsidecar.ipc.protocol import BAD_REQUEST, RegionRef, RequestError
from kvsidecar.ipc.regions import Region
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)


def map_regions(engine_id: str, layout: Layout, mode: str, refs: list[RegionRef],
                shm_prefix: str = "kvs", owner_uid: int | None = None,
                memory: str = "shm", gpu: Gpu | None = None,
                reserved: Region | None = None, allow_unsealed_shm: bool = False,
                ) -> tuple[list[Region], bool]:
    """Map (attach) or create (allocate) the engine's regions; (regions, owned).

    Allocated host segments are named ``<shm_prefix>-<engine id>-...``, so a
    restarted sidecar can find (and remove) exactly its own leftovers.

    Attach mode maps only what the engine could have mapped itself: shared
    memory named ``ENGINE_SHM_PREFIX...``, owned by the registering engine's
    uid (``owner_uid``, from its socket credentials), each exactly one layout
    region long (GPU memory: as the attach policy allows). The sidecar may run
    as a more privileged user than its engines; without these checks an engine
    could have it map, and expose to peers, another tenant's memory. POSIX shm
    (either mode) only with ``allow_unsealed_shm``: it cannot be sealed against
    truncation. Each kind is served by an entry of
    :mod:`kvsidecar.daemon.memory_kinds`.
    """
    ctx = MemoryContext(engine_id, shm_prefix, owner_uid, gpu, reserved, allow_unsealed_shm)
    if mode == "allocate":
        if refs:
            raise RequestError(BAD_REQUEST, "allocate mode takes no region references")
        return memory_kinds.allocate(memory, layout.num_regions, layout.region_bytes, ctx), True
    if len(refs) != layout.num_regions:
        raise RequestError(BAD_REQUEST, f"layout has {layout.num_regions} regions, "
                                        f"{len(refs)} region references were sent")
    return memory_kinds.attach(refs, layout, ctx), False


def release_regions(regions: list[Region], owned: bool) -> int:
    """Unmap (and, if this sidecar created them, unlink) an engine's regions.

    Blocking (hundreds of ms per GB to give the pages back): call it off the
    event loop. Failures are logged and returned as a count (the caller
    counts them in its metrics), never raised: the engine is gone either way.
    """
    failures = 0
    for r in regions:
        try:
            r.close()
            if owned:
                r.unlink()
        except Exception as e:
            log.warning("releasing region %r failed: %s", r.name, e)
            failures += 1
    return failures


def shm_prefix_for(socket_path: str) -> str:
    """``kvs-<8 hex>``: the name prefix of the segments one sidecar allocates,
    derived from its (absolute) socket path. Two sidecars never serve the same
    socket at once, so the prefix tells this sidecar's segments from every
    other's, across its own restarts."""
    digest = hashlib.sha256(os.path.abspath(socket_path).encode()).hexdigest()[:8]
    return f"kvs-{digest}"


def remove_stale_segments(prefix: str, shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the segments a previous run of this sidecar left (``<prefix>-*``).

    Only call it once this sidecar owns its socket (no other live sidecar can
    then use the same prefix). Returns the names removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in sorted(names):
        if name.startswith(prefix + "-"):
            try:
                os.unlink(os.path.join(shm_dir, name))
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("cannot remove stale shared memory %s: %s", name, e)
                continue
            removed.append(name)
    return removed


def release_late_mapping(f: asyncio.Future[tuple[list[Region], bool]]) -> None:
    """Release what a mapping whose caller gave up (cancelled) created anyway."""
    if not f.cancelled() and f.exception() is None:
        release_regions(*f.result())


def kind_of(r: Region) -> str:
    """A region's kind, as its reference is tagged (shm, reserved, cuda_ipc, ...)."""
    return str(type(r.ref()).__struct_config__.tag)


def prefault_rank(eng: EngineRank, mem_type: str) -> None:
    """Map the pages of a host engine's regions now, in the background (see
    :mod:`~kvsidecar.daemon.prefault`): otherwise the first read into each
    block pays a page fault per 4 KiB. Registration does not wait for it.
    Memory the engine attached: only its pages that exist (no hole gets
    allocated on its behalf)."""
    if mem_type != "DRAM":
        return
    size = eng.layout.region_bytes
    done = asyncio.get_running_loop().run_in_executor(
        None, partial(prefault, [(r.address, size) for r in eng.regions],
                      existing_only=not eng.owned))
    done.add_done_callback(lambda f: f.cancelled() or f.exception())


def attach_staging(eng: EngineRank, mem_type: str, metrics: Metrics) -> None:
    """Staged reads (settings.staging) for host memory only: GPU engines always
    post scattered descriptors (no host bounce, no GPU scatter kernel here)."""
    settings = eng.settings
    if settings.staging == "off" or mem_type != "DRAM" or not settings.staging_bytes:
        return
    m, e = metrics, eng.engine_id

    def gauges(in_use: int, quarantined: int) -> None:
        m.staging_bytes_in_use.labels(e).set(in_use)
        m.staging_bytes_quarantined.labels(e).set(quarantined)

    eng.staging = StagingPool(settings.staging_bytes, eng.worker, gauges,
                              m.staging_bytes_mapped.labels(e).set, lanes=eng.lanes)
    eng.staging.prepare()  # now, in the background: reads then find it ready
