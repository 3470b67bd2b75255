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
