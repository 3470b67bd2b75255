"""Map into this process the pages of an engine's host memory that exist, once, off the loop.

Why: a READ over UCX/CMA (``process_vm_readv``) and the staged scatter
(:mod:`~kvsidecar.daemon.staging`) write the D engine's pages through *this*
process's mapping of them, and P's pages are read through P's sidecar's
mapping. A page the sidecar never touched costs a page fault the first time:
about 1.1 µs per 4 KiB even when the shared memory already exists. Measured on
the 2-core host (64 MiB of existing shared memory, freshly mapped): a CMA READ
into it 70 ms against 9.4 ms once mapped, a numpy scatter 99 ms against 16 ms.
A read into blocks the sidecar had not touched yet (every block, at first)
paid that on top of its descriptors and bytes. ``MADV_POPULATE_WRITE`` maps
every page of a range in one call (13 ms per 64 MiB) and changes no byte.

Memory the sidecar allocated for the engine (allocate mode: reserved with
``fallocate`` already) is mapped whole. Of memory the engine attached, only
pages that already hold data are mapped (``mincore`` says which): an engine
may register sparse shared memory, and populating a hole would allocate it,
charged to the sidecar. Pages left out fault on first use, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

log = logging.getLogger(__name__)

#: Linux 5.14+; older kernels answer EINVAL and the pages fault on first use as before
MADV_POPULATE_WRITE = 23

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.mincore.restype = ctypes.c_int


def page_span(address: int, nbytes: int, page: int = mmap.PAGESIZE) -> tuple[int, int]:
    """The page-aligned (start, length) covering ``[address, address + nbytes)``."""
    start = address - address % page
    end = -(-(address + nbytes) // page) * page
    return start, end - start


def resident_runs(present: NDArray[np.uint8]) -> list[tuple[int, int]]:
    """(first page, page count) of each run of pages whose ``mincore`` byte has bit 0 set."""
    on = np.concatenate(([0], present & 1, [0])).astype(np.int8)
    edges = np.flatnonzero(np.diff(on))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


def prefault(spans: Sequence[tuple[int, int]], *, existing_only: bool = True,
             page: int = mmap.PAGESIZE) -> int:
    """Map writable every page of each ``(address, nbytes)`` span (``existing_only``:
    only those ``mincore`` reports resident); returns the bytes mapped.
    Blocking (ctypes releases the GIL): call it from a thread.
    Gives up on a span the kernel refuses (an old kernel, or the memory was
    unmapped meanwhile because the engine left): its pages then fault on first
    use, which is only slower."""
    done = 0
    for address, nbytes in spans:
        start, length = page_span(address, nbytes, page)
        present = np.ones(length // page, dtype=np.uint8)
        if existing_only and _libc.mincore(start, length, present.ctypes.data) != 0:
            log.debug("mincore of %d B at %#x refused (errno %d)", length, start,
                      ctypes.get_errno())
            continue
        for first, count in resident_runs(present):
            if _libc.madvise(start + first * page, count * page, MADV_POPULATE_WRITE) != 0:
                log.debug("prefaulting %d B at %#x refused (errno %d); pages fault on "
                          "first use", count * page, start + first * page, ctypes.get_errno())
                break
            done += count * page
    return done
