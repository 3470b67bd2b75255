"""What the NIXL worker is asked to do and what a finished read reports: pure data.

A :class:`ReadOp` or :class:`NotifyOp` goes to :meth:`NixlWorker.post_soon
<kvsidecar.daemon.transport.worker.NixlWorker.post_soon>` (``read`` and
``notify`` make one); a read's future resolves to its :class:`TransferStats`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["NotifyOp", "ReadOp", "TransferStats", "as_int64", "check_read", "read_bytes"]


@dataclass(frozen=True)
class TransferStats:
    """What one finished read cost.

    ``bytes`` and ``descriptors`` are what was asked for; ``post_us`` is the time
    spent posting (``transfer()``, which on host memory includes the CMA copy)
    and ``xfer_us`` the time from the post to the moment the worker saw DONE.
    Both come from NIXL's telemetry when ``telemetry`` is true, else from the
    worker's own clock. A read that travelled in one transfer with others
    (see :mod:`~kvsidecar.daemon.transport.merging`) keeps its own ``bytes``
    and ``descriptors`` and shares the transfer's times; ``reads`` is how many
    reads that transfer carried and ``first`` is true for one of them only
    (count transfers by it).
    """

    bytes: int
    descriptors: int
    post_us: float
    xfer_us: float
    telemetry: bool = False
    reads: int = 1
    first: bool = True


@dataclass(frozen=True)
class ReadOp:
    """One read for :meth:`NixlWorker.post_soon`: the arguments of :meth:`NixlWorker.read`."""

    remote_agent: str
    local_addr: npt.NDArray[np.int64]
    remote_addr: npt.NDArray[np.int64]
    length: npt.NDArray[np.int64]
    notif: bytes | None = None
    mem_type: str = "DRAM"
    dev_id: int = 0
    remote_dev_id: int | None = None
    timeout_s: float | None = None
    generation: int | None = None
    remote_mem_type: str | None = None
    #: the most reads the peer accepts named in one notification (its handshake's
    #: ``notif_batch_reads``): 2 or more lets this read share one transfer with
    #: other reads of the same flush to that agent; 0 never
    merge: int = 0


@dataclass(frozen=True)
class NotifyOp:
    """One bare notification for :meth:`NixlWorker.post_soon` (``merge`` as for
    ReadOp: notifications of one flush to that agent go as one)."""

    remote_agent: str
    message: bytes
    merge: int = 0


def as_int64(a: npt.ArrayLike) -> npt.NDArray[np.int64]:
    return np.ascontiguousarray(a, dtype=np.int64)


_uadd = np.add.reduce  # the ufunc: ndarray.sum() goes through a Python wrapper


def read_bytes(op: ReadOp) -> int:
    """How many bytes ``op`` reads."""
    return int(_uadd(as_int64(op.length)))


def check_read(op: ReadOp) -> None:
    """Raise ValueError/TypeError for arguments no read can have."""
    n = len(op.local_addr)
    for label, arr in (("local_addr", op.local_addr), ("remote_addr", op.remote_addr),
                       ("length", op.length)):
        if (arr.ndim if isinstance(arr, np.ndarray) else np.ndim(arr)) != 1:
            raise ValueError(f"{label} must be one-dimensional")
        if len(arr) != n:
            raise ValueError(
                f"local_addr, remote_addr and length differ in length "
                f"({n}, {len(op.remote_addr)}, {len(op.length)})"
            )
    if op.notif is not None and not isinstance(op.notif, bytes):
        raise TypeError("notif must be bytes")
