"""MemfdRegion.take_over: what the vLLM connector does when a restarted sidecar
reserves its KV memory again: vLLM's tensors keep their pointers, and every
byte, and from then on share pages with the new memfd."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvsidecar.ipc.memfd import MemfdRegion
from kvsidecar.ipc.memory import RegionError


def test_the_new_memfd_takes_the_old_address_with_its_bytes() -> None:
    n = 3 * 4096 + 100
    old, new = MemfdRegion.create("old", n), MemfdRegion.create("new", n)
    view = old.numpy()  # what vLLM's tensors are: views of the old mapping
    tensor = old.torch()
    view[:] = np.arange(n) % 251
    address = old.address
    new_fd = new.fd
    old.take_over(new)
    assert old.address == address and new.closed
    assert (view == np.arange(n) % 251).all() and int(tensor[n - 1]) == (n - 1) % 251
    # The memory at that address is now the new memfd's: a write through the old
    # views shows in a fresh mapping of the fd it holds, and the other way round.
    assert os.readlink(f"/proc/self/fd/{old.fd}").startswith("/memfd:new")
    with pytest.raises(OSError):
        os.fstat(new_fd)  # the region keeps a duplicate; the original went with `new`
    other = MemfdRegion.from_fd(os.dup(old.fd), n)
    view[7] = 200
    assert other.numpy()[7] == 200
    other.numpy()[9] = 201
    assert view[9] == 201 and int(tensor[9]) == 201
    other.close()
    old.close()


def test_a_replacement_of_another_size_is_refused_and_nothing_moves() -> None:
    old, new = MemfdRegion.create("old", 8192), MemfdRegion.create("new", 4096)
    old.numpy()[:] = 5
    with pytest.raises(RegionError, match="8192 B, its replacement 4096 B"):
        old.take_over(new)
    assert (old.numpy() == 5).all() and not new.closed
    old.close()
    new.close()
