"""kvsidecar: a per-GPU KV-cache transfer daemon for disaggregated LLM inference.

The import package maps the repository's top-level folders: ``kvsidecar.ipc``
(what engines import: layout, wire protocol, client), ``kvsidecar.daemon`` (the
sidecar: planner, NIXL worker, servers), ``kvsidecar.metrics`` and
``kvsidecar.sim`` (simulated engines, the transfer oracle and the demo).
"""

__version__ = "0.1.0"
