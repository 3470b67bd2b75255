"""Which bytes a decode (D) rank reads from which prefill (P) rank: pure math.

No I/O and no state of its own: every function maps layouts and block ids to
numpy arrays, so the whole transfer logic can be tested exhaustively without
NIXL (``tests/unit/test_planner_oracle.py``) and the daemon only turns offsets
into addresses. LAYOUT.md is the contract. One module per step of a plan::

    block ids ──validate──▶ arrays ──pair──▶ paired views (local, remote) per group
                                                   │
    layouts ──ranks──▶ candidate P ranks ──pieces──▶ slices of each view, per P rank
                                                   │
                                     plan: views x slices ─▶ descriptors ─▶ coalesce

- :mod:`.ranks`: the P ranks a D rank reads from and notifies.
- :mod:`.pieces`: which slice of which segment comes from which P rank (the
  sharding rule, with its diagrams), kept per pair of layouts by a
  :class:`PieceCache`.
- :mod:`.block_ids`: the one validation of a request's block ids.
- :mod:`.pairing`: which local view pairs with which remote view.
- :mod:`.plan`: the descriptors, per P rank, of one or several requests.
- :mod:`.small`: the same plan of one small attention request with Python ints
  (what the event loop plans), :mod:`.cost` a plan's size in pieces.
- :mod:`.errors`: the :class:`PlanError` of each rule a request can break.
"""

from kvsidecar.daemon.planner.arrays import I32, I64
from kvsidecar.daemon.planner.block_ids import BlockIds, check_block_ids, validate_block_ids
from kvsidecar.daemon.planner.errors import (
    BlockRangeError,
    DuplicateBlockError,
    GroupCountError,
    PairingError,
    PlanError,
    TpError,
)
from kvsidecar.daemon.planner.pairing import ManyRequest, pair_group, pair_requests
from kvsidecar.daemon.planner.pieces import (
    SHARED_PIECES,
    Piece,
    PieceCache,
    rank_pieces,
    segment_pieces,
)
from kvsidecar.daemon.planner.plan import (
    Addresses,
    RankRead,
    ReadPlan,
    coalesce,
    plan_many,
    plan_many_addressed,
    plan_read,
)
from kvsidecar.daemon.planner.ranks import candidate_ranks, expected_notifications

__all__ = [
    "I32",
    "I64",
    "SHARED_PIECES",
    "Addresses",
    "BlockIds",
    "BlockRangeError",
    "DuplicateBlockError",
    "GroupCountError",
    "ManyRequest",
    "PairingError",
    "Piece",
    "PieceCache",
    "PlanError",
    "RankRead",
    "ReadPlan",
    "TpError",
    "candidate_ranks",
    "check_block_ids",
    "coalesce",
    "expected_notifications",
    "pair_group",
    "pair_requests",
    "plan_many",
    "plan_many_addressed",
    "plan_read",
    "rank_pieces",
    "segment_pieces",
    "validate_block_ids",
]
