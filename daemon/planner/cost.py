"""What planning a read costs, counted in pieces: no I/O, no numpy."""

from __future__ import annotations

from kvsidecar.ipc.layout import Layout

__all__ = ["plan_cost"]


def plan_cost(local: Layout, remote_tp: int, blocks: int) -> int:
    """At least the descriptors a plan of ``blocks`` local pages has before
    coalescing: a page's segment pieces over every region and kernel block,
    times the P ranks each page is read from (a smaller D tp reads each page
    from several). Exact for equal tp on attention layouts whose segments
    each span every region (K and V in one page); over for K and V in
    separate regions (each segment counted in every region)."""
    per_page = local.num_regions * sum(g.sub_blocks * len(g.segments) for g in local.groups)
    return blocks * per_page * max(1, remote_tp // local.tp_size)
