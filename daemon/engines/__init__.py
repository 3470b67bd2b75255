"""Engine ranks: one registered rank (:mod:`.rank`) and the memory it serves.

The package exports :class:`~kvsidecar.daemon.engines.rank.EngineRank`, so
``from kvsidecar.daemon.engines import EngineRank`` names the rank wherever
it is used.
"""

from kvsidecar.daemon.engines.rank import EngineRank

__all__ = ["EngineRank"]
