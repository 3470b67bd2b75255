"""What one running sidecar is: its id, age, GPU, advertised address, stopping flag.

One :class:`DaemonState` is shared by the parts of a sidecar (handlers,
registry, observability). The sidecar's lifecycle (``app.Sidecar``) is its
only writer: ``gpu`` and ``handshake_address`` are set by ``start``,
``stopping`` by ``stop``; everyone else reads them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvsidecar.daemon.cuda_device import CudaDevice
from kvsidecar.daemon.peers.messages import new_daemon_id


@dataclass
class DaemonState:
    daemon_id: str = field(default_factory=new_daemon_id)
    #: monotonic time the sidecar was created (its uptime runs from here)
    created: float = field(default_factory=time.monotonic)
    #: the GPU of --device cuda:N (None: a host-memory sidecar), opened by start
    gpu: CudaDevice | None = None
    #: the address peers dial for handshakes ('' until start bound the port)
    handshake_address: str = ""
    #: the address the handshake server bound ('' until start)
    handshake_bound: str = ""
    #: set once stop began: new work is refused, polls answer at once
    stopping: bool = False
