"""Which posts of one worker flush travel together as one NIXL transfer.

Measured with bare agents (host memory, UCX/CMA): a READ costs about 0.13 ms
per ``initialize_xfer`` + ``transfer()`` call and about 0.3 ms more when it
carries a notification, while one more descriptor in the same call costs
microseconds. So the reads a flush posts to the same P agent (same agent
generation and memory kinds) go as one transfer with one notification that
names them all, if that peer advertised batched notifications
(``HandshakeInfo.notif_batch_reads``). Pure functions; the worker applies them.

A merged transfer ends (and with it every read in it) only once all of its
bytes moved, so merging stops at ``max_read_bytes`` (the worker's
:data:`~kvsidecar.daemon.transport.worker.MERGE_MAX_BYTES`): past a few MiB a
read's bytes cost more than the transfer merging saves, and a read finished
early can be scattered out of staging (or reported) while the next one copies.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def group_posts(keys: Sequence[Hashable | None], limits: Sequence[int],
                notif_bytes: Sequence[int], max_notif_bytes: int,
                read_bytes: Sequence[int] | None = None,
                max_read_bytes: int | None = None) -> list[list[int]]:
    """Indices of the posts, grouped: posts with equal non-None ``keys`` share
    a group in order of arrival while it has fewer than the smallest ``limits``
    of its members (the most reads the peer accepts in one notification), its
    notifications' bytes stay within ``max_notif_bytes`` and (when given) the
    bytes its reads move, ``read_bytes``, within ``max_read_bytes``; a full
    group is closed and the next post with that key starts a new one. A post
    with key None, a limit below 2, or bytes over a bound on its own goes
    alone. Groups come in the order of their first post, so the worker posts
    in about the order it was asked."""
    out: list[list[int]] = []
    # key -> group, limit, notification bytes, read bytes
    open_: dict[Hashable, tuple[list[int], int, int, int]] = {}
    cap = max_read_bytes
    for i, key in enumerate(keys):
        limit, size = limits[i], notif_bytes[i]
        nbytes = read_bytes[i] if read_bytes is not None else 0
        if (key is None or limit < 2 or size > max_notif_bytes
                or (cap is not None and nbytes > cap)):
            out.append([i])
            continue
        cur = open_.get(key)
        if cur is not None:
            group, glimit, gbytes, gread = cur
            lim = min(glimit, limit)
            if (len(group) < lim and gbytes + size <= max_notif_bytes
                    and (cap is None or gread + nbytes <= cap)):
                group.append(i)
                open_[key] = (group, lim, gbytes + size, gread + nbytes)
                continue
        group = [i]
        out.append(group)
        open_[key] = (group, limit, size, nbytes)
    return out
