"""The pure parts of the GPU path: device names, IPC handle bytes, VMM sizes and
the attach-mode decision (no CUDA needed)."""

from __future__ import annotations

import msgspec
import pytest

from kvsidecar.ipc.cuda_handles import (
    attach_policy,
    check_ipc_handle,
    decide_attach,
    parse_cuda_device,
    uuid_from_bytes,
    vmm_alloc_bytes,
)
from kvsidecar.ipc.protocol import CudaIpcRef, CudaVmmRef, Register, decode_request

GPU = "GPU-01234567-89ab-cdef-0123-456789abcdef"
OTHER = "GPU-ffffffff-89ab-cdef-0123-456789abcdef"


def test_uuid_is_nvidia_smi_form() -> None:
    assert uuid_from_bytes(bytes.fromhex("0123456789abcdef0123456789abcdef")) == GPU
    with pytest.raises(ValueError, match="16 bytes, got 15"):
        uuid_from_bytes(b"\0" * 15)


def test_device_parsing() -> None:
    assert parse_cuda_device("cpu") is None
    assert parse_cuda_device("cuda:3") == 3
    for bad in ("cuda", "cuda:-1", "gpu:0", "cuda:1234"):
        with pytest.raises(ValueError, match="cpu or cuda:N"):
            parse_cuda_device(bad)


def test_ipc_handle_bytes() -> None:
    h = bytes(range(64))
    assert check_ipc_handle(h) == h
    with pytest.raises(ValueError, match="64 bytes, got 63"):
        check_ipc_handle(h[:63])
    with pytest.raises(ValueError, match="all zeros"):
        check_ipc_handle(b"\0" * 64)


def test_vmm_sizes_round_up_to_the_granularity() -> None:
    two_mib = 2 << 20
    assert vmm_alloc_bytes(1, two_mib) == two_mib
    assert vmm_alloc_bytes(two_mib, two_mib) == two_mib
    assert vmm_alloc_bytes(two_mib + 1, two_mib) == 2 * two_mib


def test_gpu_refs_are_validated_on_the_wire() -> None:
    """A handle of the wrong size or a device that is not a GPU UUID fails decoding,
    naming the field, before any handler (or CUDA) sees it."""
    from kvsidecar.ipc.protocol import encode_request
    from kvsidecar.sim.models import attn

    layout = attn(2)(1, 8)
    good = Register("e", 0, layout, "attach", [CudaIpcRef(b"\1" * 64, GPU, 4096)], id=1)
    assert decode_request(encode_request(good)) == good
    raw = msgspec.msgpack.decode(encode_request(good))
    for field, value in (("handle", b"\1" * 63), ("device_uuid", "0"), ("nbytes", 0)):
        bad = {**raw, "regions": [{**raw["regions"][0], field: value}]}
        with pytest.raises(Exception, match=rf"\$\.regions\[0\]\.{field}"):
            decode_request(msgspec.msgpack.encode(bad))
    vmm = CudaVmmRef("ab" * 16, 0, GPU, 4096, 2 << 20)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(vmm), type=CudaVmmRef) == vmm


def _refs(uuid: str = GPU) -> list[CudaIpcRef]:
    return [CudaIpcRef(b"\1" * 64, uuid, 4096)]


@pytest.mark.parametrize(("policy", "check", "serve", "says"), [
    ("serve", None, True, "--cuda-attach serve"),
    ("serve", False, True, "--cuda-attach serve"),
    ("refuse", True, False, "does not register engine-allocated GPU memory"),
    ("warn", None, True, "CUDA does not document re-exporting imported memory"),
    ("warn", True, True, "CUDA does not document re-exporting imported memory"),
    ("warn", False, False, "VRAM transport check did not see a zero-copy path"),
])
def test_attach_decision(policy: str, check: bool | None, serve: bool, says: str) -> None:
    d = decide_attach(attach_policy(policy), check, _refs(), GPU)
    assert d.serve is serve
    assert says in d.message
    if not serve:
        assert "allocate=True" in d.message  # says what to do instead


@pytest.mark.parametrize("policy", ["serve", "warn", "refuse"])
def test_attach_on_another_gpu_is_always_refused(policy: str) -> None:
    d = decide_attach(attach_policy(policy), True, _refs(OTHER), GPU)
    assert not d.serve and f"is on GPU {OTHER}; this sidecar serves GPU {GPU}" in d.message


def test_attach_policy_values() -> None:
    with pytest.raises(ValueError, match="serve, warn, refuse"):
        attach_policy("maybe")


def test_only_vmm_exports_travel_by_fd() -> None:
    """The sidecar offers fds only for regions that have one: a cuda_malloc region
    (legacy handle) must not look like an fd export, a VMM export must, and its
    reference names the fd set only once it was offered."""
    from kvsidecar.ipc.cuda import CudaRegion, ExportedVmmRegion
    from kvsidecar.ipc.memory import RegionError
    from kvsidecar.ipc.regions import Device, FdExport, Region, uniform

    dev = Device(0, GPU)
    ipc = CudaRegion("m", 1 << 40, 4096, dev, CudaIpcRef(b"\1" * 64, GPU, 4096), lambda: None)
    vmm = ExportedVmmRegion("v", 1 << 41, 4096, dev, 2 << 20, lambda: None, fd=0)
    assert isinstance(ipc, Region) and isinstance(vmm, Region)
    assert not isinstance(ipc, FdExport) and isinstance(vmm, FdExport)
    with pytest.raises(RegionError, match="not been offered"):
        vmm.ref()
    vmm.share("ab" * 16, 3)
    assert vmm.ref() == CudaVmmRef("ab" * 16, 3, GPU, 4096, 2 << 20)
    assert uniform([ipc, vmm]) == ("VRAM", dev)
    with pytest.raises(RegionError, match=r"GPU memory: use \.torch\(\)"):
        ipc.numpy()
