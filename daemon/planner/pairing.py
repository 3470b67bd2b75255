"""Which local view pairs with which remote view, group by group.

Attention blocks are paired by token, not by block id: each side's logical
blocks are expanded into kernel blocks (``sub_blocks`` per page, which differ
between P and D when their tp differs), the i-th local kernel block pairs with
remote kernel block ``skip / block_tokens + i``, and pairing stops at the
shorter list. A sliding-window group (``window_tokens``) names the tails of
both sides' pages, each ending with the page of token ``num_tokens - 1``: the
two tails pair by token where they overlap. Mamba pages pair one to one and
are never trimmed.

:func:`pair_group` pairs one group of one request; :func:`pair_requests`
pairs every group of several requests, each request's pairs in turn, and
names the requests that cannot be paired with their :class:`PlanError`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from kvsidecar.daemon.planner.arrays import I64, uadd
from kvsidecar.daemon.planner.block_ids import (
    BlockIds,
    in_range,
    repeated_within,
    validate_block_ids,
)
from kvsidecar.daemon.planner.errors import PairingError, PlanError
from kvsidecar.ipc.layout import Group, Layout, view_offsets

#: one request's ids for planning: local ids, remote ids, skip_tokens, num_tokens
ManyRequest = tuple[BlockIds, BlockIds, int | None, int | None]

#: per group: the paired local views of every paired request in turn, their
#: remote views, and how many pairs each request has
Paired = list[tuple[I64, I64, I64]]


def pair_group(
    gi: int,
    local: Layout,
    remote: Layout,
    lids: I64,
    rids: I64,
    skip_tokens: int | None,
    num_tokens: int | None = None,
) -> tuple[I64, I64]:
    """Byte offsets (within a region) of paired views: (local, remote), one entry per pair."""
    lg, rg = local.groups[gi], remote.groups[gi]
    if lids.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    if lg.kind == "mamba":
        if lids.size != rids.size:
            raise PairingError(
                f"group {gi} (mamba): {lids.size} local pages vs {rids.size} remote pages; "
                "Mamba state pairs page to page and is never trimmed"
            )
        return view_offsets(local, lg, lids), view_offsets(remote, rg, rids)
    if lg.window_tokens:
        l0, r0, n = _window_pairs(gi, lg, rg, int(lids.size), int(rids.size), num_tokens)
        lk = view_offsets(local, lg, lids)
        rk = view_offsets(remote, rg, rids)
        return lk[l0:l0 + n], rk[r0:r0 + n]
    skip_k, n = attention_pairs(gi, lg, rg, int(lids.size), int(rids.size), skip_tokens,
                                num_tokens)
    lk = view_offsets(local, lg, lids)
    rk = view_offsets(remote, rg, rids)
    return lk[:n], rk[skip_k : skip_k + n]


def _window_pairs(gi: int, lg: Group, rg: Group, nl: int, nr: int,
                  num_tokens: int | None) -> tuple[int, int, int]:
    """For a sliding-window group with ``nl`` local and ``nr`` remote pages
    (nl > 0), both the tails of the request's pages: (first local kernel block
    paired, first remote kernel block paired, kernel blocks paired).

    Each side's tail ends with the page holding token ``num_tokens - 1``, so
    its first kernel block is token ``(pages_spanned - n) * page_tokens``; the
    pairs are the kernel blocks both tails hold, up to the last token."""
    if num_tokens is None or num_tokens < 1:
        raise PairingError(f"group {gi} (sliding window): a read into it needs num_tokens "
                           "(its block lists are tails ending at the last token)")
    kbs = lg.block_tokens
    firsts = []
    for side, g, n in (("local", lg, nl), ("remote", rg, nr)):
        spanned = -(-num_tokens // (g.sub_blocks * kbs))
        if n > spanned:
            raise PairingError(f"group {gi} (sliding window): {n} {side} pages, but "
                               f"{num_tokens} tokens span only {spanned}")
        firsts.append((spanned - n) * g.sub_blocks)
    lfirst, rfirst = firsts
    start = max(lfirst, rfirst)
    end = min(lfirst + nl * lg.sub_blocks, rfirst + nr * rg.sub_blocks, -(-num_tokens // kbs))
    return start - lfirst, start - rfirst, max(0, end - start)


def attention_pairs(gi: int, lg: Group, rg: Group, nl: int, nr: int,
                    skip_tokens: int | None, num_tokens: int | None) -> tuple[int, int]:
    """For an attention group with ``nl`` local and ``nr`` remote blocks (nl > 0):
    (remote kernel blocks skipped, kernel blocks paired); raises PairingError."""
    kbs = lg.block_tokens
    if skip_tokens is None:
        if lg.sub_blocks == rg.sub_blocks:
            # vLLM's "read the remote tail": the blocks D lacks are the first ones.
            skip_k = max(0, nr - nl) * rg.sub_blocks
        elif num_tokens is not None:
            # D's list is the tail of the ceil(num_tokens / D-block) blocks the prompt spans.
            total = -(-num_tokens // (lg.sub_blocks * kbs))
            skip_k = max(0, total - nl) * lg.sub_blocks
        else:
            # Block counts of the two sides cover different token spans, so no count
            # comparison can tell a prefix hit from none (stricter than LAYOUT.md 5).
            raise PairingError(
                f"group {gi}: sub_blocks differ ({lg.sub_blocks} local, {rg.sub_blocks} "
                "remote), so a prefix hit cannot be inferred from block counts; "
                "state skip_tokens or num_tokens"
            )
    else:
        logical = lg.sub_blocks * kbs
        if skip_tokens < 0 or skip_tokens % logical:
            raise PairingError(
                f"skip_tokens {skip_tokens} is not a whole number of local logical blocks "
                f"({logical} tokens)"
            )
        skip_k = skip_tokens // kbs
    lsize, rsize = nl * lg.sub_blocks, nr * rg.sub_blocks  # kernel blocks (view_offsets)
    if skip_k > rsize:
        raise PairingError(
            f"group {gi}: skip of {skip_k * kbs} tokens exceeds the {rsize * kbs} tokens "
            "the remote blocks hold"
        )
    n = min(lsize, rsize - skip_k)
    if num_tokens is not None:
        # Kernel block i starts at token (skip_k + i) * kbs; later ones hold no token.
        n = max(0, min(n, -(-num_tokens // kbs) - skip_k))
    return skip_k, n



def pair_requests(local: Layout, remote: Layout, requests: Sequence[ManyRequest]
                  ) -> tuple[list[int], Paired, dict[int, PlanError]]:
    """:func:`pair_group` for every group of every request (ids validated first):
    the indices of the requests that pair, their pairs, and the others' errors."""
    fast = _attention_pairs_many(local, remote, requests)
    if fast is not None:
        return list(range(len(requests))), fast, {}
    ngroups = len(local.groups)
    ok: list[int] = []
    pairs: list[list[tuple[I64, I64]]] = []
    failed: dict[int, PlanError] = {}
    for r, (lb, rb, skip, num) in enumerate(requests):
        try:
            lids = validate_block_ids(local, lb, "local")
            rids = validate_block_ids(remote, rb, "remote")
            pairs.append([pair_group(gi, local, remote, lids[gi], rids[gi], skip, num)
                          for gi in range(ngroups)])
        except PlanError as e:
            failed[r] = e
            continue
        ok.append(r)
    if not ok:
        return ok, [], failed
    return ok, [_joined([pr[gi] for pr in pairs]) for gi in range(ngroups)], failed


def _joined(pairs: list[tuple[I64, I64]]) -> tuple[I64, I64, I64]:
    """One group's pairs of several requests as :data:`Paired` has them."""
    if len(pairs) == 1:
        ((lk, rk),) = pairs
        return lk, rk, np.array([lk.size], np.int64)
    lks = [lk for lk, _ in pairs]
    return (np.concatenate(lks), np.concatenate([rk for _, rk in pairs]),
            np.fromiter((lk.size for lk in lks), np.int64, len(lks)))


def _attention_pairs_many(local: Layout, remote: Layout, requests: Sequence[ManyRequest]
                          ) -> Paired | None:
    """What :func:`pair_requests` gives when every request pairs, for two or more
    requests whose groups are all attention and whose ids are plain lists: the
    ids of all requests are checked and turned into views in one pass per group
    (at 16 blocks a request, numpy's per-call cost, not the data, is most of
    the work). None when that is not the case or when any request fails a
    check (the caller then pairs one by one and so names the request)."""
    if len(requests) < 2 or not _plain_attention(local, remote, requests):
        return None  # Mamba and sliding-window groups pair one request at a time
    out: Paired = []
    lall: list[I64] = []
    owners: list[I64] = []
    for gi in range(len(local.groups)):
        got = _group_pairs_many(gi, local, remote, requests)
        if got is None:
            return None
        lall.append(got[0])
        owners.append(got[1])
        out.append(got[2])
    # a local page named twice within one request (every group shares the pages)
    if len(lall) == 1:
        twice = repeated_within(lall[0], owners[0])
    else:
        twice = repeated_within(np.concatenate(lall), np.concatenate(owners))
    return None if twice else out


def _plain_attention(local: Layout, remote: Layout, requests: Sequence[ManyRequest]) -> bool:
    """Whether every group is plain attention (no window) and every request
    names its ids as one list of lists, one list per group."""
    if any(g.kind != "attention" or g.window_tokens for g in (*local.groups, *remote.groups)):
        return False
    ngroups = len(local.groups)
    for lb, rb, _, _ in requests:
        if (type(lb) is not list or type(rb) is not list or len(lb) != ngroups
                or len(rb) != ngroups):
            return False
        if ngroups == 1:  # the usual case, without two generators per request
            if type(lb[0]) is not list or type(rb[0]) is not list:
                return False
        elif any(type(ids) is not list for ids in lb) or any(type(ids) is not list for ids in rb):
            return False
    return True


def _group_pairs_many(gi: int, local: Layout, remote: Layout, requests: Sequence[ManyRequest]
                      ) -> tuple[I64, I64, tuple[I64, I64, I64]] | None:
    """Group ``gi`` of every request: all local ids, the request of each, and the
    group's :data:`Paired` entry; None when some request fails a check."""
    lg, rg = local.groups[gi], remote.groups[gi]
    nl = [len(lb[gi]) for lb, _, _, _ in requests]
    nr = [len(rb[gi]) for _, rb, _, _ in requests]
    chain = itertools.chain.from_iterable
    try:
        lids = np.fromiter(chain(lb[gi] for lb, _, _, _ in requests), np.int64, sum(nl))
        rids = np.fromiter(chain(rb[gi] for _, rb, _, _ in requests), np.int64, sum(nr))
    except (TypeError, ValueError, OverflowError):
        return None
    if not (in_range(lids, local.num_blocks) and in_range(rids, remote.num_blocks)):
        return None
    try:
        got = [attention_pairs(gi, lg, rg, a, b, skip, num) if a else (0, 0)
               for (_, _, skip, num), a, b in zip(requests, nl, nr)]
    except PlanError:
        return None
    nreq = len(requests)
    skips = np.fromiter((k for k, _ in got), np.int64, nreq)
    cnt = np.fromiter((n for _, n in got), np.int64, nreq)
    total = int(uadd(cnt))
    # request r pairs local views [lstart_r, +n_r) with remote [rstart_r + skip_r, +n_r)
    lstart = np.zeros(nreq, np.int64)
    np.cumsum(np.asarray(nl[:-1], np.int64) * lg.sub_blocks, out=lstart[1:])
    rstart = np.zeros(nreq, np.int64)
    np.cumsum(np.asarray(nr[:-1], np.int64) * rg.sub_blocks, out=rstart[1:])
    first = np.zeros(nreq, np.int64)
    np.cumsum(cnt[:-1], out=first[1:])
    within = np.arange(total, dtype=np.int64) - np.repeat(first, cnt)
    lk = view_offsets(local, lg, lids)
    rk = view_offsets(remote, rg, rids)
    owner = np.repeat(np.arange(nreq, dtype=np.int64), nl)
    return lids, owner, (lk[np.repeat(lstart, cnt) + within],
                         rk[np.repeat(rstart + skips, cnt) + within], cnt)
