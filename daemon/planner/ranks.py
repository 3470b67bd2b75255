"""Which P ranks a D rank reads from and notifies (LAYOUT.md section 4).

With ``D_tp >= P_tp`` each D rank has one candidate P rank and
``D_tp / P_tp`` D ranks share it; with ``P_tp > D_tp`` each D rank gathers
from ``P_tp / D_tp`` consecutive P ranks. A D rank notifies every candidate
once per request, whether or not it reads anything from it.
"""

from __future__ import annotations

from kvsidecar.daemon.planner.errors import TpError


def _check_tp(d_tp: int, d_rank: int, p_tp: int) -> None:
    if d_tp < 1 or p_tp < 1:
        raise TpError(f"tp sizes must be >= 1 (local {d_tp}, remote {p_tp})")
    if not 0 <= d_rank < d_tp:
        raise TpError(f"local rank {d_rank} outside tp size {d_tp}")
    if max(d_tp, p_tp) % min(d_tp, p_tp):
        raise TpError(
            f"tp sizes {d_tp} (local) and {p_tp} (remote) are not multiples of one another"
        )


def candidate_ranks(d_tp: int, d_rank: int, p_tp: int) -> tuple[int, ...]:
    """The P ranks D rank ``d_rank`` may read from, and must notify, in read-preference order."""
    _check_tp(d_tp, d_rank, p_tp)
    if d_tp >= p_tp:
        return (d_rank // (d_tp // p_tp),)
    a = p_tp // d_tp
    return tuple(range(d_rank * a, (d_rank + 1) * a))


def expected_notifications(p_tp: int, d_tp: int) -> int:
    """How many notifications one P rank receives per request from one D engine."""
    _check_tp(d_tp, 0, p_tp)
    return d_tp // p_tp if d_tp > p_tp else 1
