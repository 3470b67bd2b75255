"""D side: what a read uses of the engine rank it reads for (:class:`ReaderRank`).

A structural protocol: the daemon's registered rank
(:class:`~kvsidecar.daemon.engines.EngineRank`) satisfies it as is, and the
read's modules see no more of it than these members.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from kvsidecar.daemon.peers.links import PeerLinks
from kvsidecar.daemon.peers.messages import HandshakeInfo
from kvsidecar.daemon.staging import StagingPool
from kvsidecar.daemon.transport.worker import NixlWorker
from kvsidecar.ipc.layout import Layout
from kvsidecar.ipc.regions import Region


class ReaderRank(Protocol):
    """One registered D engine rank, as its reads see it."""

    @property
    def engine_id(self) -> str: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def layout(self) -> Layout: ...
    #: the engine's memory regions (read into; hashed when verified)
    @property
    def regions(self) -> list[Region]: ...
    #: each region's base address
    @property
    def bases(self) -> NDArray[np.int64]: ...
    #: this rank's handshake facts (memory type, device)
    @property
    def info(self) -> HandshakeInfo: ...
    #: its links to P ranks
    @property
    def peers(self) -> PeerLinks: ...
    #: lane 0: the worker whose agent P's handshake knows (it notifies)
    @property
    def worker(self) -> NixlWorker: ...
    #: every worker that posts reads, lane 0 first
    @property
    def lanes(self) -> list[NixlWorker]: ...
    #: off, auto or always
    @property
    def staging_mode(self) -> str: ...
    #: host memory for staged reads (None: never staged)
    @property
    def staging(self) -> StagingPool | None: ...
    #: post during the claim over links P confirmed this recently (0: claim first)
    @property
    def post_during_claim_s(self) -> float: ...
    #: verify every read's bytes
    @property
    def verify_bytes(self) -> bool: ...
