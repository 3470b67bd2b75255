"""Which posts of one worker flush travel together as one NIXL transfer.

Measured with bare agents (host memory, UCX/CMA): a READ costs about 0.13 ms
per ``initialize_xfer`` + ``transfer()`` call and about 0.3 ms more when it
carries a notification, while one more descriptor in the same call costs
microseconds. So the reads a flush posts to the same P agent (same agent
generation and memory kinds) go as one transfer with one notification that
names them all, if that peer advertised batched notifications
(``HandshakeInfo.notif_batch_reads``). Pure functions; the worker applies them.

A merged transfer ends (and with it every read in it) only once all of its
bytes moved, so a read of more than ``alone_bytes`` (the worker's
:data:`~kvsidecar.daemon.transport.worker.MERGE_MAX_READ_BYTES`) travels
alone: its bytes take longer than the transfer merging would save, and
finished early it can be scattered out of staging (or reported) while the
next one copies. Small reads merge as many as the peer accepts.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


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
