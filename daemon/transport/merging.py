"""Which posts of one worker flush travel together as one NIXL transfer.

A READ's post and its notification cost far more than one more descriptor in
the same READ (figures in benchmarks/RESULTS.md). So the reads a flush posts
to the same P agent (same agent generation and memory kinds) go as one
transfer with one notification that names them all, if that peer advertised
batched notifications
(``HandshakeInfo.notif_batch_reads``). Pure functions; the worker's posting
(:mod:`~kvsidecar.daemon.transport.posting`) applies them.

A merged transfer ends (and with it every read in it) only once all of its
bytes moved, so a read of more than ``alone_bytes`` (by default
:data:`MERGE_MAX_READ_BYTES`) travels alone: its bytes take longer than the
transfer merging would save, and finished early it can be scattered out of
staging (or reported) while the next one copies. Small reads merge as many as
the peer accepts. Each read of a merged transfer still gets its own outcome
(:func:`share`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kvsidecar.daemon.transport.ops import NotifyOp, ReadOp, TransferStats, as_int64, read_bytes

__all__ = ["MERGE_MAX_READ_BYTES", "group_ops", "group_posts", "merged_notify", "merged_read",
           "share"]

#: A read of more than this many bytes never merges with others into one
#: transfer: past about 2 MiB the bytes merged after a read delay its
#: completion more than the saved post and notification gain.
MERGE_MAX_READ_BYTES = 2 << 20
#: what a joined notification may add to its parts (bytes)
_JOIN_OVERHEAD = 16


def group_posts(keys: Sequence[Hashable | None], limits: Sequence[int],
                notif_bytes: Sequence[int], max_notif_bytes: int,
                read_bytes: Sequence[int] | None = None,
                alone_bytes: int | None = None) -> list[list[int]]:
    """Indices of the posts, grouped: posts with equal non-None ``keys`` share
    a group in order of arrival while it has fewer than the smallest ``limits``
    of its members (the most reads the peer accepts in one notification) and
    its notifications' bytes stay within ``max_notif_bytes``; a full group
    is closed and the next post with that key starts a new one. A post with
    key None, a limit below 2, a notification over the bound, or (when given)
    ``read_bytes`` over ``alone_bytes`` goes alone. Groups come in the order
    of their first post, so the worker posts in about the order it was asked."""
    out: list[list[int]] = []
    open_: dict[Hashable, tuple[list[int], int, int]] = {}  # key -> group, limit, bytes
    for i, key in enumerate(keys):
        limit, size = limits[i], notif_bytes[i]
        if (key is None or limit < 2 or size > max_notif_bytes
                or (read_bytes is not None and alone_bytes is not None
                    and read_bytes[i] > alone_bytes)):
            out.append([i])
            continue
        cur = open_.get(key)
        if cur is not None:
            group, glimit, gbytes = cur
            lim = min(glimit, limit)
            if len(group) < lim and gbytes + size <= max_notif_bytes:
                group.append(i)
                open_[key] = (group, lim, gbytes + size)
                continue
        group = [i]
        out.append(group)
        open_[key] = (group, limit, size)
    return out


def group_ops(ops: Sequence[ReadOp | NotifyOp], max_notif_bytes: int,
              alone_bytes: int = MERGE_MAX_READ_BYTES) -> list[list[int]]:
    """:func:`group_posts` for the ops of one flush: reads to the same agent,
    generation and memory kinds merge (reads without descriptors never),
    notifications to the same agent merge, if their ``merge`` allows."""
    keys: list[Hashable | None] = []
    sizes: list[int] = []
    nbytes: list[int] = []
    for op in ops:
        if isinstance(op, ReadOp):
            key: Hashable | None = (
                "read", op.remote_agent, op.generation, op.mem_type, op.dev_id,
                op.remote_dev_id, op.remote_mem_type) if len(op.length) else None
            sizes.append(len(op.notif or b""))
            nbytes.append(read_bytes(op) if key is not None else 0)
        else:
            key = ("notify", op.remote_agent)
            sizes.append(len(op.message))
            nbytes.append(0)
        keys.append(key if op.merge >= 2 else None)
    return group_posts(keys, [op.merge for op in ops], sizes,
                       max_notif_bytes - _JOIN_OVERHEAD, nbytes, alone_bytes)


def merged_read(reads: Sequence[ReadOp],
                join: Callable[[list[bytes]], bytes]) -> tuple[ReadOp, list[tuple[int, int]]]:
    """One read doing what ``reads`` (a group of :func:`group_ops`) do, with one
    joined notification and the earliest deadline; and each read's (bytes,
    descriptors), for :func:`share`."""
    first = reads[0]
    notes = [op.notif for op in reads if op.notif]
    timeouts = [op.timeout_s for op in reads if op.timeout_s is not None]
    merged = replace(
        first, local_addr=np.concatenate([as_int64(op.local_addr) for op in reads]),
        remote_addr=np.concatenate([as_int64(op.remote_addr) for op in reads]),
        length=np.concatenate([as_int64(op.length) for op in reads]),
        notif=join(notes) if notes else None,
        timeout_s=min(timeouts) if timeouts else None)
    return merged, [(read_bytes(op), len(op.length)) for op in reads]


def merged_notify(notifies: Sequence[NotifyOp],
                  join: Callable[[list[bytes]], bytes]) -> NotifyOp:
    """One notification carrying those of ``notifies`` (one group)."""
    return NotifyOp(notifies[0].remote_agent, join([op.message for op in notifies]))


def share(futs: Sequence[Any], parts: Sequence[tuple[int, int]] | None, merged: Any) -> None:
    """Hand a merged transfer's outcome (the future ``merged``) to each of its
    members' futures (event loop thread): its own bytes and descriptors
    (``parts``; None for notifications), the shared times; a failure fails
    them all with the same error."""
    exc = None if merged.cancelled() else merged.exception()
    for i, fut in enumerate(futs):
        if fut.done():
            continue
        if merged.cancelled():
            fut.cancel()
        elif exc is not None:
            fut.set_exception(exc)
        elif parts is None:
            fut.set_result(None)
        else:
            nbytes, ndesc = parts[i]
            got: TransferStats = merged.result()
            # Built directly: dataclasses.replace per read cost several us.
            fut.set_result(TransferStats(nbytes, ndesc, got.post_us, got.xfer_us,
                                         got.telemetry, len(futs), i == 0))
