"""Why a read request cannot be planned: one exception type per rule it breaks.

Every planning error is a :class:`PlanError` (a ``ValueError``) whose message
names the problem; the daemon returns that message to the engine as is.
"""

from __future__ import annotations


class PlanError(ValueError):
    """A read request that cannot be planned; the message names the problem."""


class TpError(PlanError):
    """The two engines' tensor-parallel sizes cannot be paired."""


class GroupCountError(PlanError):
    """A request names block ids for a different number of groups than the layout has."""


class BlockRangeError(PlanError):
    """A block id lies outside ``[0, num_blocks)`` of the side it refers to."""


class DuplicateBlockError(PlanError):
    """A local block id appears twice, so a byte would be written twice."""


class PairingError(PlanError):
    """Local and remote block lists cannot be paired (prefix ``skip``, Mamba counts)."""
