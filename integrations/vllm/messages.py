"""What the connector's two sides tell each other, through vLLM.

Workers -> scheduler: :class:`KvSidecarHandshake` once (the rank's sidecar
address and hold key), :class:`KvSidecarAddresses` when a rank registered
again. Scheduler -> workers, once per step: :class:`KvSidecarMetadata`, the
step's reads, holds, releases, preemptions and keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ...ipc.client import ReadSpec
from ...ipc.protocol import KeepItem, RemoteEngine


@dataclass
class KvSidecarHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler: where peers reach its sidecar, and
    the rank's hold key, with which the scheduler issues each finished
    request's hold tokens (it answers before its workers place the holds).
    Stays inside the engine: vLLM hands it from workers to the scheduler only."""

    engine_id: str
    tp_rank: int
    address: str
    hold_key: bytes = b""


@dataclass
class KvSidecarAddresses(KVConnectorWorkerMetadata):
    """Workers -> scheduler: the new sidecar address of each tp rank that
    registered again (its sidecar restarted: a new handshake port, unless the
    sidecar has a fixed ``--handshake-port``). Requests that finish prefill
    from then on name the new address to their readers."""

    addresses: dict[int, str] = field(default_factory=dict)
    #: the rank's new hold key (a new registration issues tokens with a new key)
    hold_keys: dict[int, bytes] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvSidecarAddresses):
            return KvSidecarAddresses({**self.addresses, **other.addresses},
                                      {**self.hold_keys, **other.hold_keys})
        return self


@dataclass
class ReadJob:
    """One D read, decided by the scheduler, run by every D worker."""

    request_id: str
    local_block_ids: list[list[int]]
    remote_engine_id: str
    remote_tp_size: int
    remote_handshake: list[str]
    remote_request_id: str
    remote_block_ids: list[list[int]]
    skip_tokens: int
    num_tokens: int
    awaited: bool  # the scheduler waits for it (False: a full prefix hit or an abort: notify only)
    #: each P rank's hold token (kv_transfer_params["remote_tokens"])
    remote_tokens: list[str] = field(default_factory=list)


@dataclass
class HoldJob:
    request_id: str
    block_ids: list[list[int]]


def read_spec(job: ReadJob) -> ReadSpec:
    return ReadSpec(job.request_id, job.local_block_ids,
                    RemoteEngine(job.remote_engine_id, job.remote_tp_size, job.remote_handshake),
                    job.remote_block_ids, remote_request_id=job.remote_request_id,
                    skip_tokens=job.skip_tokens,
                    num_tokens=job.num_tokens if job.awaited else None,
                    remote_tokens=job.remote_tokens)


@dataclass
class KvSidecarMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    reads: list[ReadJob] = field(default_factory=list)
    holds: list[HoldJob] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)
    #: requests the scheduler preempted since the last step (their blocks are free)
    preempted: list[str] = field(default_factory=list)
    #: D: admitted requests waiting for their read, whose P holds to keep alive
    keeps: list[KeepItem] = field(default_factory=list)

