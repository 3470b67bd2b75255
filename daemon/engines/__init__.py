"""Engine ranks: the ranks one sidecar serves, how they arrive and how they leave.

- :mod:`.rank`: one registered rank (memory, workers, holds, completions);
- :mod:`.table`: the table of registered and draining ranks, and its lookups;
- :mod:`.registry`: registration, retries, restarts, reservations, liveness;
- :mod:`.departures`: dropping, draining and freeing ranks;
- :mod:`.memory`, :mod:`.lanes`, :mod:`.liveness`: a rank's memory, its NIXL
  workers, and whether its process is alive.

The package exports :class:`~kvsidecar.daemon.engines.rank.EngineRank`, so
``from kvsidecar.daemon.engines import EngineRank`` names the rank wherever
it is used.
"""

from kvsidecar.daemon.engines.rank import EngineRank

__all__ = ["EngineRank"]
