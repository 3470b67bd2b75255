"""Shared-memory regions: real POSIX shm, several mappings of the same pages,
within a process and across processes."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest

from kvsidecar.ipc.layout import attention_layout
from kvsidecar.ipc.memory import (
    RegionError,
    ShmRegion,
    allocate_for_layout,
    attach_refs,
    unique_name,
)
from kvsidecar.ipc.protocol import ShmRef


def _exists(name: str) -> bool:
    try:
        ShmRegion.attach(name, 1).close()
    except RegionError:
        return False
    return True


@pytest.fixture
def region() -> Iterator[ShmRegion]:
    with ShmRegion.create(unique_name("kvtest"), 3 * mmap.PAGESIZE + 5) as r:
        yield r


def test_create_attach_and_ref(region: ShmRegion) -> None:
    assert region.owner and not region.closed
    assert region.nbytes == 3 * mmap.PAGESIZE + 5
    assert region.ref() == ShmRef(region.name, region.nbytes, 0)
    assert region.numpy().sum() == 0  # zero-filled
    with ShmRegion.attach(region.name, region.nbytes) as other:
        assert not other.owner
        assert other.address != region.address  # a second mapping of the same pages


def test_write_through_one_mapping_read_through_another(region: ShmRegion) -> None:
    with ShmRegion.attach(region.name, region.nbytes) as other:
        region.numpy()[:] = np.arange(region.nbytes, dtype=np.uint64).astype(np.uint8)
        assert np.array_equal(other.numpy(), region.numpy())
        other.torch()[7] = 201
        assert region.numpy()[7] == 201


def test_views_are_zero_copy_at_the_address(region: ShmRegion) -> None:
    a = region.numpy()
    assert a.dtype == np.uint8 and a.shape == (region.nbytes,) and a.flags.writeable
    assert a.ctypes.data == region.address
    t = region.torch()
    assert t.data_ptr() == region.address and t.numel() == region.nbytes


def test_attach_at_an_offset(region: ShmRegion) -> None:
    off = mmap.PAGESIZE + 3  # not page aligned
    region.numpy()[off : off + 4] = [1, 2, 3, 4]
    with ShmRegion.attach(region.name, 100, offset=off) as sub:
        assert sub.ref() == ShmRef(region.name, 100, off)
        assert list(sub.numpy()[:4]) == [1, 2, 3, 4]
        assert sub.address == np.asarray(sub.numpy()).ctypes.data
        sub.numpy()[4] = 9
    assert region.numpy()[off + 4] == 9


def test_attach_too_small_is_a_clear_error(region: ShmRegion) -> None:
    with pytest.raises(RegionError, match="too small"):
        ShmRegion.attach(region.name, region.nbytes + 1)
    with pytest.raises(RegionError, match="too small"):
        ShmRegion.attach(region.name, region.nbytes, offset=1)
    assert isinstance(RegionError("x"), MemoryError)


def test_attach_missing() -> None:
    with pytest.raises(RegionError, match="does not exist"):
        ShmRegion.attach(unique_name("kvtest-missing"), 10)


def test_create_existing_refuses(region: ShmRegion) -> None:
    with pytest.raises(RegionError, match="already exists"):
        ShmRegion.create(region.name, 10)


@pytest.mark.parametrize("name", ["", "a/b", "x" * 300])
def test_bad_names(name: str) -> None:
    with pytest.raises(RegionError, match="bad shared memory name"):
        ShmRegion.create(name, 10)


def test_bad_sizes() -> None:
    with pytest.raises(RegionError):
        ShmRegion.create(unique_name("kvtest"), 0)
    with pytest.raises(RegionError):
        ShmRegion.attach(unique_name("kvtest"), 10, offset=-1)


def test_close_keeps_live_views_valid() -> None:
    r = ShmRegion.create(unique_name("kvtest"), 4096)
    view = r.numpy()
    tensor = r.torch()
    view[0] = 42
    r.close()
    r.unlink()
    assert r.closed
    assert view[0] == 42 and int(tensor[0]) == 42  # still mapped: the views hold it
    view[1] = 1
    assert int(tensor[1]) == 1
    with pytest.raises(RegionError, match="closed"):
        r.numpy()
    with pytest.raises(RegionError, match="closed"):
        _ = r.address
    r.close()  # idempotent


def test_unlink_is_idempotent_and_keeps_mappings() -> None:
    r = ShmRegion.create(unique_name("kvtest"), 4096)
    r.numpy()[0] = 5
    r.unlink()
    r.unlink()
    assert not _exists(r.name)
    assert r.numpy()[0] == 5
    r.close()


def test_context_manager_unlinks_only_what_it_created() -> None:
    with ShmRegion.create(unique_name("kvtest"), 4096) as owner:
        with ShmRegion.attach(owner.name, 4096) as user:
            pass
        assert user.closed and _exists(owner.name)
    assert owner.closed and not _exists(owner.name)


def test_unique_names() -> None:
    names = {unique_name("p") for _ in range(1000)}
    assert len(names) == 1000
    assert all(n.startswith("p-") and len(n) < 31 for n in names)  # macOS limit


def test_allocate_for_layout_and_attach_refs() -> None:
    layout = attention_layout(model="m", num_layers=3, total_kv_heads=2, head_dim=8,
                              block_tokens=4, tp_size=1, num_blocks=5)
    regions = allocate_for_layout(layout, "kvtest")
    try:
        assert len(regions) == layout.num_regions == 3
        assert all(r.nbytes == layout.num_blocks * layout.page_bytes for r in regions)
        assert len({r.name for r in regions}) == 3
        mapped = attach_refs([r.ref() for r in regions])
        for i, (a, b) in enumerate(zip(regions, mapped)):
            a.numpy()[-1] = i + 1
            assert b.numpy()[-1] == i + 1
        for m in mapped:
            m.close()
    finally:
        for r in regions:
            r.close()
            r.unlink()


def test_attach_refs_is_all_or_nothing(region: ShmRegion) -> None:
    good = region.ref()
    with pytest.raises(RegionError):
        attach_refs([good, ShmRef(unique_name("kvtest-missing"), 10)])
    assert _exists(region.name)  # the creator's segment is untouched


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, check=False)


def test_across_processes_both_directions(region: ShmRegion) -> None:
    region.numpy()[:3] = [7, 8, 9]
    child = _python(f"""
        from kvsidecar.ipc.memory import ShmRegion, unique_name
        r = ShmRegion.attach({region.name!r}, {region.nbytes})
        assert list(r.numpy()[:3]) == [7, 8, 9], list(r.numpy()[:3])
        r.numpy()[3] = 10
        r.close()
        mine = ShmRegion.create({region.name + "-c"!r}, 64)
        mine.numpy()[0] = 99
        mine.close()  # left for the parent, not unlinked
    """)
    assert child.returncode == 0, child.stderr
    assert child.stderr == ""  # no resource_tracker warnings about leaked segments
    assert region.numpy()[3] == 10
    assert _exists(region.name)  # the child's exit did not unlink our segment
    with ShmRegion.attach(region.name + "-c", 64) as theirs:
        assert theirs.numpy()[0] == 99
        theirs.unlink()


def test_child_exit_does_not_unlink_with_multiprocessing_present(region: ShmRegion) -> None:
    """Importing multiprocessing (as engines do) must not bring the resource
    tracker into play for our segments."""
    child = _python(f"""
        import multiprocessing.resource_tracker
        from kvsidecar.ipc.memory import attach_refs
        from kvsidecar.ipc.protocol import ShmRef
        [r] = attach_refs([ShmRef({region.name!r}, {region.nbytes})])
        r.numpy()[0] = 1
    """)
    assert child.returncode == 0, child.stderr
    assert child.stderr == ""
    assert _exists(region.name) and region.numpy()[0] == 1


def test_dev_shm_backing() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this system")
    with ShmRegion.create(unique_name("kvtest"), 8192) as r:
        assert os.path.getsize(f"/dev/shm/{r.name}") == 8192
