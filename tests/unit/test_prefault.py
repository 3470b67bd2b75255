"""daemon/prefault.py: the existing pages of a span get mapped into this process,
holes stay holes (nothing is allocated on the engine's behalf), no byte changes,
and a span that cannot be populated is skipped without an error (its pages then
fault on first use, as before)."""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvsidecar.daemon.prefault import page_span, prefault, resident_runs

PAGE = mmap.PAGESIZE


def _rss_shmem() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem")


def test_page_span_covers_unaligned_ranges() -> None:
    assert page_span(4096, 4096, 4096) == (4096, 4096)
    assert page_span(4097, 1, 4096) == (4096, 4096)
    assert page_span(4095, 2, 4096) == (0, 8192)
    assert page_span(8192, 4096 * 3 + 1, 4096) == (8192, 4 * 4096)


def test_resident_runs() -> None:
    assert resident_runs(np.array([], np.uint8)) == []
    assert resident_runs(np.array([0, 0], np.uint8)) == []
    assert resident_runs(np.array([1, 1, 1], np.uint8)) == [(0, 3)]
    # only bit 0 means resident
    assert resident_runs(np.array([1, 0, 3, 1, 2, 0, 1], np.uint8)) == [(0, 1), (2, 2), (6, 1)]


def test_prefault_maps_existing_pages_only_and_changes_no_byte() -> None:
    """Attached memory: pages that hold data are mapped, holes stay holes."""
    pages = 256
    fd = os.memfd_create("kvs-prefault-test")
    try:
        os.ftruncate(fd, pages * PAGE)
        os.pwrite(fd, bytes(100 * PAGE), 0)  # the engine wrote pages 0-99; the rest is a hole
        os.pwrite(fd, bytes(range(16)), 3 * PAGE)
        blocks = os.fstat(fd).st_blocks
        mm = mmap.mmap(fd, pages * PAGE)
        view = np.frombuffer(mm, dtype=np.uint8)
        base = int(view.ctypes.data)
        before = _rss_shmem()
        # an unaligned span inside the allocated part: its 11 pages get mapped
        assert prefault([(base + 100, 10 * PAGE)]) == 11 * PAGE
        assert prefault([(base, pages * PAGE)]) == 100 * PAGE
        assert _rss_shmem() - before == 100 * PAGE
        assert os.fstat(fd).st_blocks == blocks  # nothing allocated in the hole
        assert view[3 * PAGE:3 * PAGE + 16].tolist() == list(range(16))
        assert np.count_nonzero(view) == 15
        del view
        mm.close()
    finally:
        os.close(fd)


def test_prefault_maps_reserved_memory_whole() -> None:
    """Memory the sidecar allocated (fallocate'd, never written): mapped whole."""
    pages = 64
    fd = os.memfd_create("kvs-prefault-test")
    try:
        os.ftruncate(fd, pages * PAGE)
        os.posix_fallocate(fd, 0, pages * PAGE)
        mm = mmap.mmap(fd, pages * PAGE)
        view = np.frombuffer(mm, dtype=np.uint8)
        before = _rss_shmem()
        assert prefault([(int(view.ctypes.data), pages * PAGE)], existing_only=False) == (
            pages * PAGE)
        assert _rss_shmem() - before == pages * PAGE
        assert not view.any()
        del view
        mm.close()
    finally:
        os.close(fd)


def test_prefault_skips_what_it_cannot_populate() -> None:
    mm = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(mm, dtype=np.uint8)
    base = int(view.ctypes.data)
    del view
    mm.close()  # unmapped now: the engine left while its pages were being mapped
    assert prefault([(base, 4 * PAGE)]) == 0
    assert prefault([(base, 4 * PAGE)], existing_only=False) == 0
