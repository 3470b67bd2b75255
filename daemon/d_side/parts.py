"""D side: where a read's posts go and how they are cut (pure, vectorised).

* :func:`lane_of`: a read with bytes from several P ranks spreads its posts
  over the lanes (``--post-lanes``), one P rank per lane.
* :func:`split_post`: a large read from one P rank is cut into a part per lane.
* :func:`pipeline`: a large verified read is cut into parts of whole digest
  chunks, hashed as each lands.
* :func:`joined`: the parts' outcomes joined back into their posts'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvsidecar.daemon import digest
from kvsidecar.daemon.d_side.addresses import I64, PostList
from kvsidecar.daemon.planner import ReadPlan
from kvsidecar.daemon.transport.worker import TransferStats

#: a read's one post (bytes from one P rank) of at least this many bytes is split
#: over the lanes, a part per lane. Raw NIXL, one READ vs its halves on two agents
#: and threads (benchmarks/raw_lanes.py, 2 vCPUs): 8 MiB 0.89x (no gain), 16 MiB
#: 1.65x, 32 MiB 1.50x, 256 MiB 1.61x.
SPLIT_MIN_BYTES = 16 << 20
_SPLIT_ALIGN = 4096


def split_post(n: int, posts: Sequence[PostList], min_bytes: int = SPLIT_MIN_BYTES
               ) -> tuple[list[PostList], list[int]] | None:
    """A read's only post with bytes cut into ``n`` parts of about equal bytes
    (cuts page aligned, descriptors cut where a part ends), one per lane, and
    which post each part belongs to; None unless there are ``n`` > 1 lanes, one
    post with bytes (others notify only; they are kept as their own parts) and
    at least ``min_bytes`` of it. Pure and vectorised.

    Why: a homogeneous read has one post, so :func:`lane_of` leaves it on lane
    0, where its CMA copy runs on one thread; cut in halves on two lanes it
    copies on two cores. The parts cover exactly the post's bytes, each local
    byte paired with the same remote byte as before."""
    full = [i for i, p in enumerate(posts) if p.length.size]
    if n < 2 or len(full) != 1:
        return None
    post = posts[full[0]]
    total = int(post.nbytes or post.length.sum())
    if total < min_bytes:
        return None
    ends = np.cumsum(post.length)
    starts = ends - post.length
    cuts = (np.arange(1, n, dtype=np.int64) * total // n) // _SPLIT_ALIGN * _SPLIT_ALIGN
    points = np.union1d(starts, cuts)  # where a piece begins, in the post's byte order
    points = points[(points >= 0) & (points < total)]
    idx = np.searchsorted(ends, points, side="right")  # the descriptor each piece is in
    off = points - starts[idx]
    size = np.append(points[1:], total) - points
    local, remote = post.local[idx] + off, post.remote[idx] + off
    chunk = np.searchsorted(cuts, points, side="right")
    parts: list[PostList] = []
    owner: list[int] = []
    for i, p in enumerate(posts):
        if i != full[0]:
            parts.append(p)
            owner.append(i)
            continue
        for k in range(n):
            mine = chunk == k
            if mine.any():
                parts.append(PostList(p.rank, local[mine], remote[mine], size[mine], 0,
                                      int(size[mine].sum())))
                owner.append(i)
    return parts, owner


#: a verified read's only post of at least this many bytes is cut into parts of
#: whole digest chunks, about this many bytes each and at most PIPELINE_MAX_PARTS,
#: posted one after the other on its lane: D hashes each part once it landed,
#: beside the next part's copy (:func:`pipeline`). Measured (64 MiB, 2 vCPUs
#: shared by both sidecars): D's hashing after the last byte landed 2.5 ms in 4
#: parts, 7-10 ms hashing the whole read after it landed.
PIPELINE_MIN_BYTES = 16 << 20
PIPELINE_MAX_PARTS = 16


def pipeline(posts: Sequence[PostList], plan: ReadPlan, chunk_bytes: int,
             min_bytes: int = PIPELINE_MIN_BYTES, max_parts: int = PIPELINE_MAX_PARTS
             ) -> tuple[list[PostList], list[int], list[int],
                        list[tuple[I64, I64, I64]]] | None:
    """A verified read's only post with bytes cut for hashing as it lands: its
    parts and the post each belongs to (as :func:`split_post`), which parts
    carry the cut post, and the region-relative pieces (D's side) of each of
    them. None unless one post has bytes, at least ``min_bytes`` of them, in
    one digest request's pieces (:data:`~kvsidecar.daemon.digest.MAX_RANGES`)
    and the cut gives 2 parts or more (about ``min_bytes`` each, at most
    ``max_parts``). Cuts fall on whole chunks of the post's stream, so the
    parts' digests joined are the post's. Pure."""
    full = [i for i, p in enumerate(posts) if p.length.size]
    if len(full) != 1:
        return None
    post = posts[full[0]]
    rr = next((r for r in plan.reads if r.remote_rank == post.rank), None)
    if (rr is None or post.nbytes < min_bytes or rr.length.size > digest.MAX_RANGES
            or not np.array_equal(rr.length, post.length)):
        return None
    cuts = digest.chunk_cuts(post.length, chunk_bytes,
                             max(2, min(max_parts, post.nbytes // min_bytes)))
    if not cuts.size:
        return None
    idx, off, size, run = digest.cut_stream(post.length, cuts)
    local, remote = post.local[idx] + off, post.remote[idx] + off
    region, loff = rr.region[idx].astype(np.int64), rr.local_offset[idx] + off
    out: list[PostList] = []
    owner: list[int] = []
    mine: list[int] = []
    pieces: list[tuple[I64, I64, I64]] = []
    for i, p in enumerate(posts):
        if i != full[0]:
            out.append(p)
            owner.append(i)
            continue
        for k in range(cuts.size + 1):
            sel = run == k
            mine.append(len(out))
            out.append(PostList(p.rank, local[sel], remote[sel], size[sel], 0,
                                int(size[sel].sum())))
            owner.append(i)
            pieces.append((region[sel], loff[sel], size[sel]))
    return out, owner, mine, pieces


def joined(results: list[Any], owner: list[int], n: int) -> list[Any]:
    """The outcome of each of ``n`` posts from its parts' (:func:`split_post`): the
    first failure of its parts, else their bytes and descriptors summed, the
    longest post and transfer times."""
    out: list[Any] = [None] * n
    for r, i in zip(results, owner):
        have = out[i]
        if isinstance(have, BaseException):
            continue  # its first failure stands
        if have is None or isinstance(r, BaseException):
            out[i] = r
        elif isinstance(r, TransferStats):
            out[i] = TransferStats(have.bytes + r.bytes, have.descriptors + r.descriptors,
                                   max(have.post_us, r.post_us), max(have.xfer_us, r.xfer_us),
                                   have.telemetry and r.telemetry)
    return out


def lane_of(n: int, posts: Sequence[PostList]) -> list[int] | None:
    """The lane of each post when a read spreads over ``n`` lanes: its i-th post
    with bytes on lane i mod n (P rank by P rank, in candidate order), bare
    notifications on lane 0; None when every post would go on lane 0 anyway (one
    lane, or bytes from one P rank: a homogeneous read stays on lane 0 with its
    notification attached).

    Why per P rank: each P rank's transfer is one NIXL post whose CMA copy runs
    inside ``transfer()`` on the posting thread; posts to different P ranks on
    different threads copy in parallel (raw NIXL, 2 x 16,384 scattered 4 KiB
    descriptors from two P processes: 1.50x with two agents on two threads,
    ``benchmarks/raw_lanes.py``)."""
    if n <= 1:
        return None
    out, k = [], 0
    for post in posts:
        if post.length.size:
            out.append(k % n)
            k += 1
        else:
            out.append(0)
    return out if k > 1 else None
