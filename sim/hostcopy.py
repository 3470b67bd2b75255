"""A NIXL-free transport for read plans: plain memcpy between numpy buffers.

Named as the stand-in it is. The planner's oracle tests use it to check plans
without processes, and benchmarks use it as the memcpy baseline; every real
transfer in the daemon goes through NIXL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from kvsidecar.daemon.planner import ReadPlan

U8 = NDArray[np.uint8]


def apply_plan(plan: ReadPlan, local: Sequence[U8], remote: Mapping[int, Sequence[U8]]) -> int:
    """Copy every descriptor of ``plan`` from ``remote[rank][region]`` into ``local[region]``.

    Returns the bytes copied. Raises IndexError if a descriptor leaves a buffer,
    so a plan that would touch memory outside a region cannot pass silently.
    """
    _check_disjoint(plan)
    copied = 0
    for rr in plan.reads:
        src_bufs = remote[rr.remote_rank]
        for reg, lo, ro, n in zip(rr.region.tolist(), rr.local_offset.tolist(),
                                  rr.remote_offset.tolist(), rr.length.tolist()):
            dst, src = local[reg], src_bufs[reg]
            if lo < 0 or ro < 0 or lo + n > dst.size or ro + n > src.size:
                raise IndexError(
                    f"descriptor region {reg} local [{lo}, {lo + n}) remote [{ro}, {ro + n}) "
                    f"outside buffers of {dst.size} / {src.size} bytes"
                )
            dst[lo : lo + n] = src[ro : ro + n]
            copied += n
    return copied


def _check_disjoint(plan: ReadPlan) -> None:
    """Applied in order, overlapping writes would pass when the last one is right:
    refuse them, so the oracle sees every byte written exactly once."""
    if not plan.reads:
        return
    reg = np.concatenate([r.region for r in plan.reads]).astype(np.int64)
    lo = np.concatenate([r.local_offset for r in plan.reads])
    ln = np.concatenate([r.length for r in plan.reads])
    order = np.lexsort((lo, reg))
    reg, lo, ln = reg[order], lo[order], ln[order]
    same = reg[1:] == reg[:-1]
    bad = same & (lo[1:] < lo[:-1] + ln[:-1])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"plan writes region {int(reg[i])} bytes [{int(lo[i + 1])}, "
                         f"{int(lo[i] + ln[i])}) twice")
