"""The transfer oracle of LAYOUT.md section 6, written independently of the planner.

A request's full-model logical state gets a unique-looking byte for every
coordinate (attention: region, token, head, byte; Mamba: region, page
position, unit, byte). :func:`fill_shard` writes rank r's shard of it into
that rank's pages; :func:`check_received` says whether D's pages hold exactly
D's shard for every token from ``skip`` to the prompt length and every Mamba
byte, and whether every page the request does not name still holds poison.

It shares only the layout structs with the planner and restates the sharding
rule itself, so a planner bug cannot hide behind the same bug here.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from kvsidecar.ipc.layout import Layout, Segment

U8 = NDArray[np.uint8]
POISON = 0xA5

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def logical_bytes(key: Sequence[int], a: NDArray[np.int64], b: NDArray[np.int64],
                  c: NDArray[np.int64]) -> U8:
    """One byte per coordinate (a, b, c) under ``key``, broadcast over a, b, c."""
    with np.errstate(over="ignore"):
        h: NDArray[np.uint64] = np.asarray(np.uint64(0x9E3779B97F4A7C15))
        for k in key:
            h = _mix(h ^ np.uint64(k & 0xFFFFFFFFFFFFFFFF))
        x = (np.asarray(a, np.uint64) * np.uint64(0x100000001B3)) ^ h
        x = _mix(x) ^ np.asarray(b, np.uint64)
        x = _mix(x) ^ (np.asarray(c, np.uint64) << np.uint64(17))
        return (_mix(x) & np.uint64(0xFF)).astype(np.uint8)


def held_units(seg: Segment, tp: int, rank: int) -> tuple[int, int]:
    """LAYOUT.md section 3, restated: the units rank ``rank`` of ``tp`` holds."""
    u = seg.units_total
    if seg.sharding == "replicated":
        return 0, u
    if tp > u:
        return rank * u // tp, rank * u // tp + 1
    return rank * (u // tp), (rank + 1) * (u // tp)


def _regions(seg: Segment, layout: Layout) -> Sequence[int]:
    return seg.regions or range(layout.num_regions)


@dataclass(frozen=True)
class Request:
    """One request's logical state: a seed and how many tokens it has."""

    seed: int
    prompt_tokens: int


def _attention_values(req: Request, region: int, gi: int, si: int, seg: Segment,
                      tp: int, rank: int, tokens: NDArray[np.int64], kbs: int) -> U8:
    """Bytes of one attention segment for kernel blocks starting at ``tokens``:
    shape (n_blocks, units_local * kbs * token_bytes) in [unit][token][byte] order."""
    u0, u1 = held_units(seg, tp, rank)
    tb = seg.nbytes_local // (u1 - u0) // kbs
    t = tokens[:, None, None, None] + np.arange(kbs)[None, None, :, None]
    u = np.arange(u0, u1)[None, :, None, None]
    b = np.arange(tb)[None, None, None, :]
    vals = logical_bytes((req.seed, region, gi, si, 1), t, u, b)
    shape = (tokens.size, u1 - u0, kbs, tb)
    return np.broadcast_to(vals, shape).reshape(tokens.size, (u1 - u0) * kbs * tb)


def _mamba_values(req: Request, region: int, gi: int, si: int, seg: Segment, tp: int,
                  rank: int, positions: NDArray[np.int64]) -> U8:
    """Bytes of one Mamba segment for page positions: (n_pages, nbytes_local)."""
    u0, u1 = held_units(seg, tp, rank)
    ub = seg.nbytes_local // (u1 - u0)
    p = positions[:, None, None]
    u = np.arange(u0, u1)[None, :, None]
    b = np.arange(ub)[None, None, :]
    vals = logical_bytes((req.seed, region, gi, si, 2), p, u, b)
    shape = (positions.size, u1 - u0, ub)
    return np.broadcast_to(vals, shape).reshape(positions.size, (u1 - u0) * ub)


def _views(layout: Layout, gi: int, ids: NDArray[np.int64], first_token: int
           ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(byte offset in region, first token or page position) of each view a block list names."""
    g = layout.groups[gi]
    if g.kind == "mamba":
        return ids * layout.page_bytes, np.arange(ids.size, dtype=np.int64)
    k = np.arange(g.sub_blocks, dtype=np.int64)
    offs = (ids[:, None] * layout.page_bytes + k[None, :] * g.kernel_block_bytes).reshape(-1)
    toks = first_token + np.arange(offs.size, dtype=np.int64) * g.block_tokens
    return offs, toks


def _scatter(buf: U8, offs: NDArray[np.int64], seg_off: int, rows: U8) -> None:
    if rows.size == 0:
        return
    idx = (offs[:, None] + seg_off + np.arange(rows.shape[1])[None, :]).reshape(-1)
    buf[idx] = rows.reshape(-1)


def fill_shard(buffers: Sequence[U8], layout: Layout, rank: int,
               block_ids: Sequence[Sequence[int]], req: Request,
               first_tokens: Sequence[int] | None = None) -> None:
    """Write rank ``rank``'s shard of ``req`` into the pages ``block_ids`` name (P side).

    An attention group's list starts at token 0, or at ``first_tokens[group]``
    (a sliding-window group whose first pages the engine dropped)."""
    for gi, g in enumerate(layout.groups):
        ids = np.asarray(block_ids[gi], dtype=np.int64)
        offs, pos = _views(layout, gi, ids, first_tokens[gi] if first_tokens else 0)
        for si, seg in enumerate(g.segments):
            for r in _regions(seg, layout):
                if g.kind == "mamba":
                    rows = _mamba_values(req, r, gi, si, seg, layout.tp_size, rank, pos)
                else:
                    rows = _attention_values(req, r, gi, si, seg, layout.tp_size, rank, pos,
                                             g.block_tokens)
                _scatter(buffers[r], offs, seg.offset, rows)


def check_received(buffers: Sequence[U8], layout: Layout, rank: int,
                   block_ids: Sequence[Sequence[int]], req: Request, skip_tokens: int = 0,
                   poison: int = POISON, ignore_blocks: Collection[int] = (),
                   first_tokens: Sequence[int] | None = None) -> list[str]:
    """Differences between D rank ``rank``'s pages and its shard of ``req``; empty if none.

    Attention tokens are checked from ``skip_tokens`` (D's block list starts
    there; per group ``first_tokens[group]`` when given, e.g. a sliding window's
    first page) to the prompt length; Mamba segments in full; every byte of a page
    the request does not name must still be ``poison``, except ``ignore_blocks``
    (pages other requests in flight own).
    """
    problems: list[str] = []
    named = np.zeros(layout.num_blocks, dtype=bool)
    for group_ids in block_ids:
        named[np.asarray(group_ids, dtype=np.int64)] = True
    if ignore_blocks:
        named[np.asarray(list(ignore_blocks), dtype=np.int64)] = True
    for gi, g in enumerate(layout.groups):
        gids = np.asarray(block_ids[gi], dtype=np.int64)
        offs, pos = _views(layout, gi, gids, first_tokens[gi] if first_tokens else skip_tokens)
        for si, seg in enumerate(g.segments):
            for r in _regions(seg, layout):
                buf = buffers[r]
                if g.kind == "mamba":
                    rows = _mamba_values(req, r, gi, si, seg, layout.tp_size, rank, pos)
                    keep = np.ones(rows.shape, dtype=bool)
                else:
                    kbs = g.block_tokens
                    rows = _attention_values(req, r, gi, si, seg, layout.tp_size, rank, pos, kbs)
                    u0, u1 = held_units(seg, layout.tp_size, rank)
                    tb = rows.shape[1] // ((u1 - u0) * kbs)
                    tok = pos[:, None, None, None] + np.arange(kbs)[None, None, :, None]
                    keep = np.broadcast_to(tok < req.prompt_tokens,
                                           (pos.size, u1 - u0, kbs, tb)).reshape(rows.shape)
                if rows.size == 0:
                    continue
                idx = offs[:, None] + seg.offset + np.arange(rows.shape[1])[None, :]
                got = buf[idx]
                bad = (got != rows) & keep
                if bad.any():
                    v, c = np.argwhere(bad)[0]
                    problems.append(
                        f"region {r} group {gi} ({g.kind}) segment {seg.name!r}: "
                        f"{int(bad.sum())} wrong bytes; first in view {v} (page offset "
                        f"{int(offs[v]) % layout.page_bytes}, "
                        f"block {int(offs[v]) // layout.page_bytes})"
                        f" byte {c}: got {int(got[v, c])}, want {int(rows[v, c])}"
                    )
    for r in range(layout.num_regions):
        pages = buffers[r][: layout.num_blocks * layout.page_bytes].reshape(layout.num_blocks, -1)
        untouched = pages[~named]
        if untouched.size and (untouched != poison).any():
            blk = np.flatnonzero(~named)[np.flatnonzero((untouched != poison).any(axis=1))[0]]
            problems.append(
                f"region {r}: page {int(blk)} is not named by the request but was written"
            )
    return problems


def poison(buffers: Sequence[U8], value: int = POISON) -> None:
    for b in buffers:
        b[:] = value
