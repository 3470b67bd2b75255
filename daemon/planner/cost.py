"""What planning a read costs, counted in pieces: no I/O, no numpy."""

from __future__ import annotations

from kvsidecar.ipc.layout import Layout, segment_regions

__all__ = ["plan_cost"]


def plan_cost(local: Layout, remote_tp: int, blocks: int) -> int:
    """At least the descriptors a plan of ``blocks`` local pages has before
    coalescing: a page's segment pieces, each in the regions it lives in (every
    region, or K's and V's own when they are kept apart) and every kernel
    block, times the P ranks each page is read from (a smaller D tp reads each
    page from several). Exact for equal tp on attention layouts."""
    per_page = sum(g.sub_blocks * sum(len(segment_regions(seg, local.num_regions))
                                      for seg in g.segments)
                   for g in local.groups)
    return blocks * per_page * max(1, remote_tp // local.tp_size)
