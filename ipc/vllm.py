"""kvsidecar as a vLLM v1 KV connector: P/D through the sidecars with one config change.

::

    --kv-transfer-config '{"kv_connector": "KvSidecarConnector",
                           "kv_connector_module_path": "kvsidecar.ipc.vllm",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_connector_extra_config": {
                               "sidecar_socket": "/run/kvsidecar/cpu{rank}.sock"}}'

vLLM builds the connector twice: in the scheduler process (role SCHEDULER,
pure bookkeeping, no I/O) and in every worker (role WORKER, one per tp rank,
the only side that talks to a sidecar, through :class:`SidecarClient`).
Nothing NIXL runs inside vLLM: the rank's sidecar owns the agent, the peer
handshakes and the transfers.

Request flow (pull, as vLLM's NixlConnector)::

    P scheduler  request_finished        -> hold job + kv_transfer_params (sidecar addresses)
    P worker     start_load_kv           -> hold(blocks, lease)
                 get_transfer_results    <- poll: sent | expired | aborted  => finished_sending
    D scheduler  get_num_new_matched_tokens / update_state_after_alloc -> read job
    D worker     start_load_kv           -> read(local, remote, skip_tokens, num_tokens)
                 get_transfer_results    <- poll: received => finished_recving
                                                  failed   => finished_recving + invalid blocks
                                                              (one group: vLLM keeps the valid
                                                              prefix), or + failed_recving

Errors never leave a connector call (vLLM takes any exception for a fatal
engine error): a refused read is the same failed completion a failed transfer
gives ("finished receiving, failed"), a refused hold ends the request's send,
a sidecar that lost the rank's registration (it restarted) fails what was in
flight and is registered with again, and a sidecar that does not answer
leaves its requests waiting for its answer (see "transfers" in
:class:`_WorkerSide`). A keepalive thread keeps an idle worker registered
(:mod:`kvsidecar.ipc.keepalive`); D keeps P's holds of the requests it
admitted until it reads them (``Keep``).

Memory: :meth:`KvSidecarConnector.get_mem_pool_context` makes vLLM's one KV
allocation land where the sidecar can reach it: a reservation the sidecar
allocates and owns (``memory`` ``memfd``, the CPU default; ``cuda_vmm`` /
``cuda_malloc`` on a GPU, opt-in and not yet run with vLLM on a GPU), or POSIX
shared memory this connector creates (``shm``), and ``register_kv_caches``
registers its layer ranges with the sidecar in attach mode (no copy). A KV
cache vLLM allocated elsewhere is refused at start-up, as is a GPU worker
without a GPU ``memory``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.overrides import TorchFunctionMode
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from . import hold_token
from .client import (
    Duplicate,
    HoldSpec,
    ReadSpec,
    SidecarClient,
    SidecarError,
    SidecarTimeout,
    UnknownEngine,
)
from .keepalive import Keepalive
from .kv_pool import SidecarKVPool
from .memfd import MemfdRegion
from .memory import ENGINE_SHM_PREFIX, RegionError, ShmRegion, unique_name
from .protocol import MAX_BATCH, Completion, Held, KeepItem, MemoryKind, RemoteEngine
from .regions import Region
from .vllm_layout import (
    AttentionGroupSpec,
    GdnGroupSpec,
    GroupSpec,
    Mamba1GroupSpec,
    Mamba2GroupSpec,
    TensorPlacement,
    UnsupportedConfig,
    VllmLayout,
    build_layout,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["KvSidecarConnector", "KvSidecarHandshake", "KvSidecarMetadata", "UnsupportedConfig"]

log = logging.getLogger(__name__)

NULL_BLOCK = 0
"""vLLM's null block: padding for skipped positions, never transferred or read into."""

TESTED_VLLM = ("0.33.0",)

NEEDS_MINOR = 1
"""The sidecar protocol minor this connector relies on (``received`` completions
carry their descriptor count); an older sidecar is refused at start-up."""
RESERVE_MINOR = 2
"""The minor that brought reservations (``memory`` other than ``shm``)."""
BATCH_MINOR = 5
"""The minor that brought batches: a step's holds (and reads) go in one message."""
KEEPALIVE_MINOR = 9
"""The minor that brought keepalive pings (``Ping.engines``): before it an idle
worker is released after the sidecar's ``--engine-lease``."""
REPAIR_PAUSE_S = 1.0
"""After a sidecar did not answer, or the rank could not register again: tried
again this long after (doubling, up to REPAIR_MAX_S, while it keeps failing)."""
REPAIR_MAX_S = 30.0
KEEP_MINOR = 10
"""The minor that brought ``Keep``: before it D does not keep P's holds while
its requests wait (they then live P's hold timeout)."""
DEFAULT_HOLD_TIMEOUT_S = 30.0
"""How long P's sidecar keeps blocks no reader claimed (vLLM NixlConnector's
``kv_lease_duration``): the time for D to admit the request; from then on D
keeps them (``keep_every_s``) until it reads, and a D that is gone lets them
go one ``--hold-lease`` after its last claim."""
TOKEN_MINOR = 11
"""The minor that brought hold tokens (a sidecar without them cannot be read from)."""
TOKEN_LIFE_S = 600.0
"""How long the hold tokens the scheduler issues are valid (past vLLM's 480 s hold)."""


# --------------------------------------------------------------------------
# Settings and messages between the two sides
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` keys (all optional).

    ``sidecar_socket``: the rank's sidecar socket; ``{rank}`` / ``{local_rank}``
    are filled in (default: the sidecar's own default for the device).
    ``sidecar_sockets``: one socket per tp rank instead.
    ``hold_timeout_s``: how long P's sidecar keeps blocks no reader claimed
    (default DEFAULT_HOLD_TIMEOUT_S; a D that admitted the request keeps
    claiming it every ``keep_every_s`` until it reads). ``client_timeout_s``:
    per call (10 s).
    ``memory``: where the KV cache lives (:func:`_memory_for`): ``memfd``
    (CPU default), ``shm``, or on a GPU ``cuda_vmm`` / ``cuda_malloc``.
    ``kernel_block_size``: tokens per attention kernel block. Not needed: the
    worker reads it from the attention views vLLM registers (and refuses a
    setting that disagrees); it only shapes the scheduler's start-up check.
    """

    sidecar_socket: str | None = None
    sidecar_sockets: tuple[str, ...] = ()
    hold_timeout_s: float | None = None
    client_timeout_s: float = 10.0
    keep_every_s: float = 3.0
    kernel_block_size: int | None = None
    memory: str | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> Settings:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise UnsupportedConfig(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        socks = extra.get("sidecar_sockets") or ()
        hold = extra.get("hold_timeout_s")
        kbs = extra.get("kernel_block_size")
        memory = extra.get("memory")
        return cls(extra.get("sidecar_socket"), tuple(str(s) for s in socks),
                   DEFAULT_HOLD_TIMEOUT_S if hold is None else float(hold),
                   float(extra.get("client_timeout_s", 10.0)),
                   float(extra.get("keep_every_s", 3.0)),
                   None if kbs is None else int(kbs),
                   None if memory is None else str(memory))

    def socket_for(self, rank: int, local_rank: int, device: str) -> str:
        if self.sidecar_sockets:
            if rank >= len(self.sidecar_sockets):
                raise UnsupportedConfig(f"sidecar_sockets names {len(self.sidecar_sockets)} "
                                        f"sockets, rank {rank} has none")
            return self.sidecar_sockets[rank]
        if self.sidecar_socket:
            return self.sidecar_socket.format(rank=rank, local_rank=local_rank)
        base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
        return os.path.join(base, "kvsidecar", f"{device.replace(':', '')}.sock")


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


def _read_spec(job: ReadJob) -> ReadSpec:
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


def _clip(block_ids: Sequence[Sequence[int]], kinds: Sequence[str],
          spec_blocks: Sequence[int], window_blocks: Sequence[int] = ()) -> list[list[int]]:
    """The blocks a transfer names, per group.

    Mamba groups: only the state-bearing slot (the last real block before the
    speculative scratch slots), as vLLM's own connector sends. Sliding-window
    groups: only the last ``window_blocks`` blocks (``cdiv(window, block_size)
    + 1``, NixlConnector's clip), the tail that holds the window; vLLM has
    already replaced the blocks before it by the null block. Attention groups:
    the null block never appears in a list except as leading padding (tokens
    out of the window, or of no group), which holds no token this transfer
    needs; it is dropped so it is neither held, read into, nor taken for a
    duplicate.
    """
    out: list[list[int]] = []
    windows = list(window_blocks) or [0] * len(kinds)
    for ids, kind, spec, win in zip(block_ids, kinds, spec_blocks, windows):
        if win:
            ids = list(ids)[-win:]
        real = [b for b in ids if b != NULL_BLOCK]
        if kind == "mamba":
            if spec and len(real) > 1:
                real = real[: len(real) - min(spec, len(real) - 1)]
            out.append(real[-1:])
        else:
            out.append(real)
    return out


# --------------------------------------------------------------------------
# Scheduler side
# --------------------------------------------------------------------------


class _SchedulerSide:
    """Bookkeeping only: decides reads, holds and releases; no I/O."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 settings: Settings) -> None:
        kt = vllm_config.kv_transfer_config
        assert kt is not None and kt.engine_id is not None
        self.engine_id: str = kt.engine_id
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.kv_cache_config = kv_cache_config
        groups = kv_cache_config.transfer_groups
        model = str(vllm_config.model_config.model) if vllm_config.model_config else "?"
        self.kinds = [_group_kind(g.kv_cache_spec, model) for g in groups]
        self.block_sizes = [g.kv_cache_spec.block_size for g in groups]
        #: blocks a sliding-window group transfers (0: every block)
        self.window_blocks = [_window_blocks(g.kv_cache_spec) for g in groups]
        self.spec_blocks = [getattr(g.kv_cache_spec, "num_speculative_blocks", 0) or 0
                            for g in groups]
        self.has_mamba = "mamba" in self.kinds
        self.addresses: list[str] = []
        self.hold_keys: list[bytes] = []
        # A token lives as long as the hold may (vLLM keeps P's blocks 480 s).
        self.token_life_s = max(TOKEN_LIFE_S, 2 * (settings.hold_timeout_s or 0.0))
        self._reads: dict[str, ReadJob] = {}
        self._holds: dict[str, HoldJob] = {}
        self._releases: set[str] = set()
        self._reading: set[str] = set()  # awaited reads handed to the workers
        #: D: admitted requests not read yet (their P holds are kept alive)
        self._waiting: dict[str, KeepItem] = {}
        self._keep_every_s = settings.keep_every_s
        self._last_keep = -math.inf

    # ------------------------------------------------------------ handshake

    def set_handshakes(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        addrs: dict[int, str] = {}
        keys: dict[int, bytes] = {}
        for rank, meta in metadata.items():
            if not isinstance(meta, KvSidecarHandshake):
                raise UnsupportedConfig(f"rank {rank} sent {type(meta).__name__}, not the "
                                        "kvsidecar handshake (mixed connectors?)")
            addrs[rank] = meta.address
            keys[rank] = meta.hold_key
        missing = sorted(set(range(self.tp_size)) - set(addrs))
        if missing:
            raise UnsupportedConfig(f"no sidecar address from tp ranks {missing}")
        self.addresses = [addrs[r] for r in range(self.tp_size)]
        self.hold_keys = [keys[r] for r in range(self.tp_size)]

    # ------------------------------------------------------------ P side

    def on_new_request(self, request: Request) -> None:
        """D: an admitted request P holds blocks for is kept alive until its read
        starts (:class:`~kvsidecar.ipc.protocol.Keep`). Mamba: P computes the
        state of token N-1 only; D recomputes token N from it (the rule of
        vLLM's NixlConnector). P drops the last prompt token."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            item = _keep_item(params)
            if item is not None:
                self._waiting[request.request_id] = item
        if not (self.has_mamba and params and params.get("do_remote_decode")):
            return
        if params.get("_kvsidecar_truncated") or request.num_prompt_tokens <= 1:
            return
        if request.prompt_token_ids is None or request.get_skip_reading_prefix_cache():
            return
        del request.prompt_token_ids[-1]
        del request._all_token_ids[-1]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_kvsidecar_truncated"] = True

    def request_finished(self, request: Request, block_ids: Sequence[Sequence[int]]
                         ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        rid = request.request_id
        self._waiting.pop(rid, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # D: finished before its read was scheduled (abort): tell P with a
            # notify-only read so its hold ends now rather than at the lease.
            self._reads[rid] = self._read_job(rid, params, [[] for _ in self.kinds], 0, 0,
                                              awaited=False)
            params["do_remote_prefill"] = False
            return False, None
        if rid in self._reading:
            # D: aborted while its read is in flight: release it; the worker
            # reports it finished once the sidecar says no transfer writes any more.
            self._releases.add(rid)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED):
            return False, None  # P aborted: nothing to hand over
        blocks = _clip(self.kv_cache_config.select_transfer_block_ids(list(block_ids)),
                       self.kinds, self.spec_blocks, self.window_blocks)
        if not any(blocks):
            return False, None
        if not self.addresses:
            raise UnsupportedConfig("no sidecar addresses: set_xfer_handshake_metadata was "
                                    "never called")
        self._holds[rid] = HoldJob(rid, blocks)
        # The holds are placed by the workers next step; their tokens are issued
        # now, with each rank's hold key, for exactly the blocks held.
        expires = math.ceil(time.time() + self.token_life_s)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_block_ids": blocks,
            "remote_handshake": list(self.addresses),
            "tp_size": self.tp_size,
            "remote_num_tokens": request.num_computed_tokens,
            "transfer_mode": "kvsidecar",
            "remote_tokens": hold_token.issue_all(self.hold_keys, self.engine_id, rid, blocks,
                                                  expires),
        }

    # ------------------------------------------------------------ D side

    def num_remote_tokens(self, request: Request) -> int:
        """Prompt tokens P computed: all of them, or N-1 with Mamba state."""
        n = int(request.num_prompt_tokens)
        return n - 1 if self.has_mamba and n > 1 else n

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = self.num_remote_tokens(request) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        rid = request.request_id
        self._waiting.pop(rid, None)  # its read claims from now on
        ids = self.kv_cache_config.select_transfer_block_ids(
            blocks.get_unhashed_block_ids_all_groups()) if num_external_tokens > 0 else None
        local: list[list[int]]
        if ids is None:
            local = [[] for _ in self.kinds]  # a full local prefix hit: notify only
            skip = num = 0
        else:
            local = _clip(ids, self.kinds, self.spec_blocks, self.window_blocks)
            groups = self.kv_cache_config.select_transfer_block_ids(blocks.blocks)
            skip = 0
            # The local prefix hit, from a group that keeps every block (a
            # sliding-window group nulls the hit's blocks out of its window).
            for g, kind, bs, win in zip(groups, self.kinds, self.block_sizes,
                                        self.window_blocks):
                if kind == "attention" and not win:
                    skip = bs * sum(b.block_hash is not None and not b.is_null for b in g)
                    break
            else:
                if any(self.window_blocks):
                    # Sliding window only (Mistral-style): the read ends where P's
                    # tokens end, which its window tails are aligned to.
                    skip = max(0, self.num_remote_tokens(request) - num_external_tokens)
            num = skip + num_external_tokens
        awaited = num_external_tokens > 0
        self._reads[rid] = self._read_job(rid, params, local, skip, num, awaited=awaited)
        if awaited:
            self._reading.add(rid)
        params["do_remote_prefill"] = False

    def _read_job(self, rid: str, params: dict[str, Any], local: list[list[int]], skip: int,
                  num: int, *, awaited: bool) -> ReadJob:
        try:
            return ReadJob(
                rid, local, str(params["remote_engine_id"]), int(params["tp_size"]),
                [str(a) for a in params["remote_handshake"]],
                str(params["remote_request_id"]),
                [list(map(int, g)) for g in params["remote_block_ids"]], skip, num, awaited,
                [str(t) for t in params.get("remote_tokens", ())],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"request {rid}: kv_transfer_params are not kvsidecar's "
                             f"(missing or bad {e}); pass P's params to D verbatim") from None

    def update_connector_output(self, finished_recving: set[str] | None) -> None:
        for rid in finished_recving or ():
            self._reading.discard(rid)

    def update_addresses(self, meta: KVConnectorWorkerMetadata | None) -> None:
        """Ranks that registered again with a restarted sidecar: their new address
        and hold key (the tokens of requests that finish prefill from now on)."""
        if not isinstance(meta, KvSidecarAddresses):
            return
        for rank, key in meta.hold_keys.items():
            if 0 <= rank < len(self.hold_keys):
                self.hold_keys[rank] = key
        for rank, address in meta.addresses.items():
            if 0 <= rank < len(self.addresses) and self.addresses[rank] != address:
                log.warning("kvsidecar: engine %s tp rank %d: sidecar address %s -> %s",
                            self.engine_id, rank, self.addresses[rank], address)
                self.addresses[rank] = address

    def build_meta(self, preempted: set[str] | None = None) -> KvSidecarMetadata:
        meta = KvSidecarMetadata(list(self._reads.values()), list(self._holds.values()),
                                 sorted(self._releases), sorted(preempted or ()))
        now = time.monotonic()
        if self._waiting and now - self._last_keep >= self._keep_every_s:
            meta.keeps = list(self._waiting.values())
            self._last_keep = now
        self._reads.clear()
        self._holds.clear()
        self._releases.clear()
        return meta


def _keep_item(params: dict[str, Any]) -> KeepItem | None:
    """What keeps P's hold of a request (None: params that are not kvsidecar's;
    the read reports that)."""
    try:
        return KeepItem(RemoteEngine(str(params["remote_engine_id"]), int(params["tp_size"]),
                                     [str(a) for a in params["remote_handshake"]]),
                        str(params["remote_request_id"]),
                        [str(t) for t in params.get("remote_tokens", ())])
    except (KeyError, TypeError, ValueError):
        return None


def _group_kind(spec: object, model: str = "") -> str:
    """``attention`` or ``mamba``; :class:`UnsupportedConfig` naming the model
    and the spec for any other KV-cache spec (by exact type: a subclass such as
    ``SlidingWindowMLASpec`` or ``RSWASpec`` has its own page semantics)."""
    kind = _SPEC_KINDS.get(type(spec))
    if kind is None:
        of = f" of model {model}" if model else ""
        raise UnsupportedConfig(
            f"KV-cache group spec {type(spec).__name__}{of} is not supported by kvsidecar "
            f"(supported: {', '.join(t.__name__ for t in _SPEC_KINDS)}; see the README, "
            "'Model families')"
        )
    return kind


_SPEC_KINDS: dict[type, str] = {FullAttentionSpec: "attention", MLAAttentionSpec: "attention",
                                SlidingWindowSpec: "attention", MambaSpec: "mamba"}


def _window_blocks(spec: object) -> int:
    """Blocks a sliding-window group transfers: ``cdiv(window, block_size) + 1``
    (the window need not start on a block boundary), as NixlConnector; 0 for
    every other group."""
    if not (isinstance(spec, SlidingWindowSpec) and type(spec) is SlidingWindowSpec):
        return 0  # (a subclass, e.g. SlidingWindowMLASpec, is refused by _group_kind)
    return -(-int(spec.sliding_window) // int(spec.block_size)) + 1


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------


class _ShmKVPool(TorchFunctionMode):
    """vLLM's one KV allocation (``torch.zeros(n, dtype=int8)``) placed in new
    POSIX shared memory, so the sidecar can map the same pages.

    A TorchFunctionMode (the mechanism behind ``with torch.device(...)``)
    sees every torch call in the ``with`` block and serves exactly the
    expected-size int8 CPU allocation; everything else passes through.
    """

    def __init__(self, nbytes: int, prefix: str) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.prefix = prefix
        self.region: ShmRegion | None = None

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and self.region is None and self._is_kv_buffer(args, kwargs):
            self.region = ShmRegion.create(unique_name(self.prefix), self.nbytes)
            return self.region.torch().view(torch.int8)  # fresh shm reads as zeros
        return func(*args, **kwargs)

    def _is_kv_buffer(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        size = args[0] if len(args) == 1 else (tuple(args) if args else kwargs.get("size"))
        if isinstance(size, (tuple, list)) and len(size) == 1:
            size = size[0]
        device = kwargs.get("device")
        return (size == self.nbytes and kwargs.get("dtype") == torch.int8
                and (device is None or torch.device(device).type == "cpu"))


class _WorkerSide:
    """One tp rank: registers its KV cache with its sidecar and drives transfers."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 settings: Settings) -> None:
        kt = vllm_config.kv_transfer_config
        assert kt is not None and kt.engine_id is not None
        self.engine_id: str = kt.engine_id
        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = _tp_rank(vllm_config)
        device = vllm_config.device_config.device_type if vllm_config.device_config else "cpu"
        self.memory = _memory_for(device, settings.memory)
        self.vl = layout_for(vllm_config, kv_cache_config, settings.kernel_block_size)
        self.one_group = len(kv_cache_config.kv_cache_groups) == 1
        self.socket = settings.socket_for(self.tp_rank, vllm_config.parallel_config.rank, device)
        self.client = SidecarClient(self.socket, timeout_s=settings.client_timeout_s)
        try:
            pong = self.client.ping()
        except SidecarError as e:
            self.client.close()
            raise UnsupportedConfig(f"no kvsidecar answers at {self.socket} (tp rank "
                                    f"{self.tp_rank}): {e}") from e
        if pong.minor < NEEDS_MINOR:
            self.client.close()
            raise UnsupportedConfig(
                f"the kvsidecar at {self.socket} speaks protocol {pong.version}.{pong.minor}; "
                f"this connector needs {pong.version}.{NEEDS_MINOR} or later (it reports "
                "descriptor counts): upgrade the sidecar")
        if pong.minor < TOKEN_MINOR:
            self.client.close()
            raise UnsupportedConfig(
                f"the kvsidecar at {self.socket} speaks protocol {pong.version}.{pong.minor}; "
                f"this connector needs {pong.version}.{TOKEN_MINOR} or later (hold tokens): "
                "upgrade the sidecar")
        if self.memory != "shm" and pong.minor < RESERVE_MINOR:
            self.client.close()
            raise UnsupportedConfig(
                f"memory {self.memory!r} needs a sidecar reservation (protocol "
                f"{pong.version}.{RESERVE_MINOR}); the kvsidecar at {self.socket} speaks "
                f"{pong.version}.{pong.minor}: upgrade it, or use memory 'shm' on CPU")
        #: a step's holds and reads go in one message each (a sidecar before
        #: BATCH_MINOR gets them one by one)
        self._batches = pong.minor >= BATCH_MINOR
        self._pool: _ShmKVPool | None = None
        self._kvpool: SidecarKVPool | None = None
        self.regions: list[Region] = []
        self.handshake: KvSidecarHandshake | None = None
        self._holding: set[str] = set()
        self._reading: dict[str, tuple[ReadJob, float, float]] = {}  # job, start, post time
        self._released: set[str] = set()
        self._early: list[Completion] = []  # refusals of read(), reported like failures
        self._invalid: set[int] = set()
        self.stats = NixlKVConnectorStats()
        #: holds that ended without a completion (refused, lost): finished_sending next
        self._sends_ended: set[str] = set()
        #: holds and reads whose request got no answer (see "transfers" below)
        self._uncertain: set[str] = set()
        self._hold_blocks: dict[str, list[list[int]]] = {}  # uncertain holds' blocks
        self._lost = ""  # why the sidecar has no registration of this rank ('' while it has)
        self._unreachable = ""  # why the sidecar is taken for unreachable ('' while it answers)
        self._next_repair = 0.0
        self._pause = REPAIR_PAUSE_S
        self._keepalive: Keepalive | None = None
        self._keepalive_minor = pong.minor >= KEEPALIVE_MINOR
        self._keeps = pong.minor >= KEEP_MINOR  # the sidecar keeps P's holds for us
        #: registrations of this rank with its sidecar (more than 1: it registered again)
        self.registrations = 0
        self._unpublished = False  # registered again: the scheduler must learn the address
        self._reserved_again = False  # lost: the KV memory moved into a new reservation

    # ------------------------------------------------------------ memory

    def mem_pool_context(self) -> contextlib.AbstractContextManager[Any]:
        sizes = {t.size for t in self.kv_cache_config.kv_cache_tensors}
        if len(sizes) != 1:
            raise UnsupportedConfig(f"expected one KV backing allocation, got sizes {sizes}")
        size = sizes.pop()
        if self.memory == "shm":
            self._pool = _ShmKVPool(size, f"{ENGINE_SHM_PREFIX}vllm{self.tp_rank}")
            return self._pool
        # The sidecar allocates (and owns) the memory; vLLM's one KV allocation
        # becomes a view of it (ipc/kv_pool.py). One reservation per engine id
        # per sidecar: each tp rank needs its own sidecar.
        try:
            region = self.client.reserve(self.engine_id, size, self.memory)
        except (SidecarError, OSError) as e:
            hint = _ONE_RANK if isinstance(e, Duplicate) else ""
            raise UnsupportedConfig(f"the kvsidecar at {self.socket} could not reserve {size} B "
                                    f"of {self.memory!r} for tp rank {self.tp_rank}'s KV cache: "
                                    f"{e}{hint}") from e
        self._kvpool = SidecarKVPool(region, expect_bytes=size)
        return self._kvpool

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        tensors = list(_tensors(kv_caches.values()))
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        base: Region | None = None
        if self._pool is not None:
            base = self._pool.region
        elif self._kvpool is not None and self._kvpool.tensor is not None:
            base = self._kvpool.region
        if base is None or storages != {base.address}:
            raise UnsupportedConfig(
                "vLLM's KV cache is not in kvsidecar shared memory: it must be allocated "
                "inside KvSidecarConnector.get_mem_pool_context() (vLLM >= 0.33 does this "
                f"for connectors; tested: {', '.join(TESTED_VLLM)})"
            )
        kbs = self._kernel_block_size(kv_caches)
        if kbs is not None:
            # The layout follows the attention backend's kernel blocks as vLLM
            # allocated them, so sub_blocks is what the kernels use.
            self.vl = layout_for(self.vllm_config, self.kv_cache_config, kbs)
        if self._kvpool is not None:
            self.regions = self._kvpool.views([(r.offset, r.nbytes) for r in self.vl.regions])
        else:
            assert isinstance(base, ShmRegion)
            self.regions = [ShmRegion.attach(base.name, r.nbytes, offset=r.offset)
                            for r in self.vl.regions]
        try:
            reg = self.client.register(self.engine_id, self.tp_rank, self.vl.layout,
                                       regions=self.regions)
        except SidecarError as e:
            hint = _ONE_RANK if isinstance(e, Duplicate) else ""
            raise UnsupportedConfig(f"the kvsidecar at {self.socket} refused tp rank "
                                    f"{self.tp_rank}'s KV cache: {e}{hint}") from e
        self.handshake = KvSidecarHandshake(self.engine_id, self.tp_rank,
                                            reg.handshake_address, reg.hold_key)
        self.registrations += 1
        log.info("kvsidecar: engine %s rank %d registered %d regions of %d B at %s "
                 "(handshake %s)", self.engine_id, self.tp_rank, len(self.regions),
                 self.vl.layout.region_bytes, self.socket, reg.handshake_address)
        if self._keepalive_minor:
            self._keepalive = Keepalive(self.socket, [self.engine_id],
                                        timeout_s=self.settings.client_timeout_s).start()
        else:
            log.warning("kvsidecar: the sidecar at %s speaks protocol minor < %d: this idle "
                        "worker is released after its --engine-lease; upgrade the sidecar",
                        self.socket, KEEPALIVE_MINOR)

    def _kernel_block_size(self, kv_caches: dict[str, Any]) -> int | None:
        """Tokens per kernel block of the attention views vLLM registered
        (``[kernel blocks, heads, tokens, K|V]``), checked against the setting."""
        sizes: set[int] = set()
        for g in self.kv_cache_config.transfer_groups:
            if _group_kind(g.kv_cache_spec) != "attention":
                continue
            for name in g.layer_names:
                t = kv_caches.get(name)
                if isinstance(t, torch.Tensor) and t.dim() == 4:
                    sizes.add(int(t.shape[2]))  # [kernel blocks, heads, tokens, K|V]
                elif isinstance(t, torch.Tensor) and t.dim() == 3:
                    sizes.add(int(t.shape[1]))  # MLA: [kernel blocks, tokens, latent]
        if not sizes:
            return self.settings.kernel_block_size
        if len(sizes) > 1:
            raise UnsupportedConfig(f"attention layers use different kernel block sizes "
                                    f"{sorted(sizes)}; kvsidecar needs one")
        kbs = sizes.pop()
        if self.settings.kernel_block_size not in (None, kbs):
            raise UnsupportedConfig(
                f"kernel_block_size {self.settings.kernel_block_size} is set, but vLLM's "
                f"attention backend uses kernel blocks of {kbs} tokens; drop the setting")
        return kbs

    # ------------------------------------------------------------ transfers
    #
    # No sidecar error leaves this class as an exception: vLLM takes any
    # exception from a connector call for a fatal engine error. Each becomes
    # the outcome of the requests it concerns, by what it says of the
    # sidecar's access to our memory:
    #
    # * refused (the sidecar answered no): that request only: a hold ends its
    #   send, a read is a failed read;
    # * ``UnknownEngine`` (the sidecar at our socket has no registration of
    #   this rank: it restarted, or released it): a sidecar lets an engine's
    #   memory go only after its transfers ended, so everything in flight ends
    #   now as failed (:meth:`_lose`) and the rank registers again
    #   (:meth:`_register_again`);
    # * no answer (``SidecarTimeout``: a stopped, overloaded or dead sidecar):
    #   whether it took the request is unknown, and a request it took may still
    #   read or write our blocks, so nothing of it is reported yet: the request
    #   is *uncertain* until the sidecar answers again (:meth:`_settle`).
    #   Meanwhile the sidecar is *unreachable*: it is asked again after a pause
    #   that doubles up to REPAIR_MAX_S, so a stuck sidecar costs vLLM one client
    #   timeout per pause, not one per call; new holds wait (uncertain) to be
    #   placed when it answers, new reads fail at once (D recomputes rather than
    #   wait on a silent sidecar; nothing was asked of it).

    def preempted(self, meta: KvSidecarMetadata) -> None:
        """Preemption frees a request's blocks for reuse at once, so no transfer
        may still write into them. vLLM 0.33 preempts only running requests, and
        a request runs only after its read was reported finished: a preempted
        request has nothing in flight, and P's hold ended with D's notification.
        Should a later vLLM preempt a request whose read is still in flight,
        the read is released at once (P is told by the abort) and the breach
        logged as an error: its blocks may be written until the abort lands."""
        for rid in meta.preempted:
            if rid in self._reading and rid not in self._released:
                log.error("kvsidecar: request %s was preempted while its read was in "
                          "flight; releasing it (its freed blocks may still be written "
                          "until the abort completes)", rid)
                self._release(rid)

    @property
    def _down(self) -> str:
        """Why no new work goes to the sidecar now ('' when it does)."""
        return self._lost or self._unreachable

    def _release(self, rid: str) -> None:
        self._released.add(rid)
        if self._lost:
            return  # it failed already, with everything in flight
        if self._unreachable:
            self._uncertain.add(rid)  # released once the sidecar answers
            return
        try:
            self.client.release(self.engine_id, rid)
        except SidecarTimeout as e:
            self._no_answer(rid, "release", e)
        except UnknownEngine as e:
            self._lose(str(e))
        except SidecarError as e:  # finished meanwhile: its completion says how
            log.debug("kvsidecar: release %s: %s", rid, e)

    def start(self, meta: KvSidecarMetadata) -> None:
        self._repair()
        if meta.keeps:
            self._keep(meta.keeps)
        self._start_holds(meta.holds)
        for rid in meta.releases:
            if rid in self._reading:
                self._release(rid)
        self._start_reads(meta.reads)

    def _start_holds(self, holds: Sequence[HoldJob]) -> None:
        """Place a step's holds (in batches of at most MAX_BATCH where the sidecar
        takes batches); each refused one ends its send (:meth:`_hold_failed`)."""
        if not holds:
            return
        outcomes: list[Held | SidecarError] = []
        if self._lost:
            for h in holds:
                self._hold_failed(h.request_id, self._lost)
            return
        if self._unreachable:
            for h in holds:
                log.warning("kvsidecar: request %s: held once the sidecar answers again (%s)",
                            h.request_id, self._unreachable)
                self._hold_later(h)
            return
        if self._batches and len(holds) > 1:
            for i in range(0, len(holds), MAX_BATCH):
                part = holds[i:i + MAX_BATCH]
                try:
                    outcomes += self.client.hold_many(self.engine_id, [
                        HoldSpec(h.request_id, h.block_ids,
                                 timeout_s=self.settings.hold_timeout_s) for h in part])
                except SidecarError as e:
                    outcomes += [e] * len(part)
        else:
            for h in holds:
                try:
                    outcomes.append(self.client.hold(self.engine_id, h.request_id, h.block_ids,
                                                     timeout_s=self.settings.hold_timeout_s))
                except SidecarError as e:
                    outcomes.append(e)
        for h, o in zip(holds, outcomes):
            self._held(h, o)

    def _held(self, h: HoldJob, outcome: Held | SidecarError) -> None:
        rid = h.request_id
        if not isinstance(outcome, SidecarError):
            self._holding.add(rid)
        elif isinstance(outcome, SidecarTimeout):
            self._hold_later(h)
            self._no_answer(rid, "hold", outcome)
        else:
            if isinstance(outcome, UnknownEngine):
                self._lose(str(outcome))
            self._hold_failed(rid, self._lost or f"refused: {outcome}")

    def _keep(self, items: Sequence[KeepItem]) -> None:
        """Have the sidecar keep P's holds of the requests waiting for their read
        (best effort: a sidecar that cannot is logged; the read finds out)."""
        if self._down or not self._keeps:
            return
        for i in range(0, len(items), MAX_BATCH):
            try:
                self.client.keep(self.engine_id, items[i:i + MAX_BATCH])
            except UnknownEngine as e:
                self._lose(str(e))
                return
            except SidecarError as e:
                log.warning("kvsidecar: keeping %d waiting request(s) alive at the prefill "
                            "side failed: %s", len(items), e)
                return

    def _hold_later(self, h: HoldJob) -> None:
        """Place ``h`` when the sidecar answers again (:meth:`_settle`); its blocks
        stay vLLM's until its send ends."""
        self._holding.add(h.request_id)
        self._hold_blocks[h.request_id] = h.block_ids
        self._uncertain.add(h.request_id)

    def _hold_failed(self, rid: str, why: str) -> None:
        """P cannot keep ``rid``'s blocks for its reader: its send ends now (vLLM
        frees the blocks; D's read of them fails and D recomputes). Counted as
        a failed transfer: the request's KV never leaves P."""
        log.error("kvsidecar: request %s: its KV cannot be held for the decode side (%s); "
                  "its blocks are freed and the decode side's read of them will fail",
                  rid, why)
        self._holding.discard(rid)
        self._uncertain.discard(rid)
        self._hold_blocks.pop(rid, None)
        self.stats.record_failed_transfer()
        self._sends_ended.add(rid)

    def _start_reads(self, jobs: Sequence[ReadJob]) -> None:
        if not jobs:
            return
        if self._down:
            for job in jobs:
                self._started(job, self._down, time.perf_counter(), 0.0)
            return
        if not (self._batches and len(jobs) > 1):
            for job in jobs:
                self._start_read(job)
            return
        for i in range(0, len(jobs), MAX_BATCH):
            part = jobs[i:i + MAX_BATCH]
            t0 = time.perf_counter()
            out: list[SidecarError | None]
            try:
                out = self.client.read_many(self.engine_id, [_read_spec(job) for job in part])
            except SidecarError as e:
                out = [e] * len(part)
            each = (time.perf_counter() - t0) / len(part)
            for job, refused in zip(part, out):
                self._started(job, refused, t0, each)

    def _start_read(self, job: ReadJob) -> None:
        t0 = time.perf_counter()
        spec = _read_spec(job)
        refused: SidecarError | None = None
        try:
            self.client.read(self.engine_id, spec.request_id, spec.local_block_ids,
                             spec.remote, spec.remote_block_ids,
                             remote_request_id=spec.remote_request_id,
                             skip_tokens=spec.skip_tokens, num_tokens=spec.num_tokens,
                             remote_tokens=spec.remote_tokens)
        except SidecarError as e:
            refused = e
        self._started(job, refused, t0, time.perf_counter() - t0)

    def _started(self, job: ReadJob, refused: SidecarError | str | None, t0: float,
                 post_s: float) -> None:
        """Track a read the sidecar took, or make its refusal a failed read
        (one route for errors); a read without an answer is uncertain."""
        rid = job.request_id
        self._reading[rid] = (job, t0, post_s)
        if refused is None:
            return
        if isinstance(refused, SidecarTimeout):
            self._no_answer(rid, "read", refused)
            return
        if isinstance(refused, UnknownEngine):
            self._lose(str(refused))
        why = refused if isinstance(refused, str) else self._lost or f"refused: {refused}"
        self._early.append(Completion(rid, "failed", why, job.local_block_ids))

    def _no_answer(self, rid: str, what: str, e: SidecarError) -> None:
        """``rid``'s ``what`` got no answer: uncertain until the sidecar answers."""
        log.error("kvsidecar: request %s: no answer from the sidecar to its %s (%s); it is "
                  "settled once the sidecar answers again", rid, what, e)
        self._uncertain.add(rid)
        self._unanswered(e)

    def _unanswered(self, e: SidecarError) -> None:
        """The sidecar did not answer: ask it again after a pause (doubling)."""
        if not self._unreachable:
            self._pause = REPAIR_PAUSE_S
            log.error("kvsidecar: engine %s rank %d: the sidecar at %s does not answer (%s); "
                      "new transfers fail until it does", self.engine_id, self.tp_rank,
                      self.socket, e)
        else:
            self._pause = min(2 * self._pause, REPAIR_MAX_S)
        self._unreachable = f"the sidecar at {self.socket} does not answer ({e})"
        self._next_repair = time.monotonic() + self._pause

    def _lose(self, why: str) -> None:
        """The sidecar has no registration of this rank any more (it restarted or
        released it). It ended our transfers before it let our memory go, so
        nothing in flight can still touch our blocks: every hold ends its send,
        every read fails (a released one ends aborted), all reported by the next
        :meth:`results`; the rank registers again at the next step."""
        if self._lost:
            return
        self._lost = (f"the sidecar at {self.socket} lost engine {self.engine_id!r} rank "
                      f"{self.tp_rank}'s registration ({why})")
        self._unreachable = ""
        log.error("kvsidecar: %s: failing %d hold(s) and %d read(s) in flight; registering "
                  "again", self._lost, len(self._holding), len(self._reading))
        for rid in sorted(self._holding):
            self._hold_failed(rid, self._lost)
        early = {c.request_id for c in self._early}
        for rid, (job, _, _) in self._reading.items():
            if rid not in early:
                self._early.append(Completion(rid, self._ended_kind(rid), self._lost,
                                              job.local_block_ids))
        self._uncertain.clear()
        self._next_repair = 0.0
        self._pause = REPAIR_PAUSE_S

    def _ended_kind(self, rid: str) -> Literal["aborted", "failed"]:
        """How a read that ends without a transfer ends: aborted if released."""
        return "aborted" if rid in self._released else "failed"

    def _repair(self) -> None:
        """Before a step's work: notice a lost registration (the keepalive's word,
        or an unreachable sidecar answering again), settle uncertain requests,
        and register again once lost."""
        ka = self._keepalive
        due = time.monotonic() >= self._next_repair
        if not self._lost and ((self._unreachable and due)
                               or (ka is not None and self.engine_id in ka.missing)):
            self._confirm_registered()
        if self._uncertain and not self._down:
            self._settle()
        if self._lost and time.monotonic() >= self._next_repair:
            self._register_again()

    def _confirm_registered(self) -> None:
        """Ask the sidecar, on our own connection, whether it still has this rank
        (the keepalive's answer may predate our registration)."""
        try:
            pong = self.client.ping([self.engine_id])
        except SidecarError as e:
            self._unanswered(e)
            return
        if self._unreachable:
            log.warning("kvsidecar: engine %s rank %d: the sidecar at %s answers again",
                        self.engine_id, self.tp_rank, self.socket)
            self._unreachable = ""
        if self.engine_id not in pong.engines:
            self._lose("it no longer lists the rank: it restarted, or released the rank")
        elif self._keepalive is not None:
            self._keepalive.clear(self.engine_id)

    def _settle(self) -> None:
        """Settle each uncertain request now that the sidecar answers. A read is
        released: the sidecar either has it (``Ok``: its completion follows, as
        for any release) or never took it (refused: it ends now, nothing of it
        can touch our blocks). A hold is placed again: ``Held`` or
        ``Duplicate``, it is held, and its reader may still read it."""
        for rid in sorted(self._uncertain):
            try:
                if rid in self._holding:
                    self._hold_again(rid)
                else:
                    self.client.release(self.engine_id, rid)
            except SidecarTimeout as e:
                self._unanswered(e)
                return
            except UnknownEngine as e:
                self._lose(str(e))
                return
            except SidecarError as e:
                self._uncertain.discard(rid)
                if rid in self._holding:
                    self._hold_failed(rid, f"refused: {e}")
                elif rid in self._reading:
                    job = self._reading[rid][0]
                    self._early.append(Completion(
                        rid, self._ended_kind(rid), f"the sidecar never took the read ({e})",
                        job.local_block_ids))
            else:
                self._uncertain.discard(rid)

    def _hold_again(self, rid: str) -> None:
        with contextlib.suppress(Duplicate):  # Duplicate: the first one was placed
            self.client.hold(self.engine_id, rid, self._hold_blocks[rid],
                             timeout_s=self.settings.hold_timeout_s)
        self._hold_blocks.pop(rid, None)

    def _register_again(self) -> None:
        """Register this rank's KV memory again (the sidecar lost it): the same
        memory, with what it holds (vLLM's prefix cache stays valid).

        Memory this connector attached (``shm``) registers as it is. Memory the
        lost registration's sidecar allocated (``memfd``) is out of a restarted
        sidecar's reach: the new sidecar reserves a new memfd, the KV bytes are
        copied into it, and it is mapped at the old address
        (:meth:`~kvsidecar.ipc.memfd.MemfdRegion.take_over`), so vLLM's tensors
        keep their pointers. GPU reservations cannot be moved that way: the rank
        stays unregistered (each request fails, logged) until the engine restarts.
        """
        try:
            if self._kvpool is not None and not self._reserved_again:
                self._move_reservation()
                self._reserved_again = True
            reg = self.client.register(self.engine_id, self.tp_rank, self.vl.layout,
                                       regions=self.regions)
        except (SidecarError, RegionError, OSError) as e:
            # Unanswered: the next try joins the registration it began, in the same
            # reservation. Refused: reserve again first (the sidecar may have
            # restarted once more).
            self._reserved_again &= isinstance(e, SidecarTimeout)
            log.error("kvsidecar: engine %s rank %d: registering again with the sidecar at "
                      "%s failed (%s); its requests fail until it succeeds (tried again in "
                      "%g s)", self.engine_id, self.tp_rank, self.socket, e, self._pause)
            self._next_repair = time.monotonic() + self._pause
            self._pause = min(2 * self._pause, REPAIR_MAX_S)
            return
        self._lost = ""
        self._reserved_again = False
        self._pause = REPAIR_PAUSE_S
        self.registrations += 1
        self._unpublished = True
        if self._keepalive is not None:
            self._keepalive.clear(self.engine_id)
        self.handshake = KvSidecarHandshake(self.engine_id, self.tp_rank,
                                            reg.handshake_address, reg.hold_key)
        log.warning("kvsidecar: engine %s rank %d registered again with the sidecar at %s "
                    "(handshake %s)", self.engine_id, self.tp_rank, self.socket,
                    reg.handshake_address)

    def _move_reservation(self) -> None:
        assert self._kvpool is not None
        old = self._kvpool.region
        if not isinstance(old, MemfdRegion):
            raise RegionError(f"{self.memory!r} memory the lost sidecar allocated cannot be "
                              "registered with another sidecar; restart the engine")
        try:
            new = self.client.reserve(self.engine_id, old.nbytes, self.memory)
        except Duplicate:  # left by a registration that failed after it: drop, reserve again
            self.client.deregister(self.engine_id)
            new = self.client.reserve(self.engine_id, old.nbytes, self.memory)
        if not isinstance(new, MemfdRegion):
            new.close()
            raise RegionError(f"the sidecar reserved {type(new).__name__}, not a memfd")
        old.take_over(new)

    def results(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        self._repair()
        items: list[Completion] = []
        if not self._down:
            try:
                items = self.client.poll(self.engine_id)
            except UnknownEngine as e:
                self._lose(str(e))
            except SidecarTimeout as e:  # its completions come again with a later poll
                self._unanswered(e)
            except SidecarError as e:
                log.error("kvsidecar: engine %s rank %d: the sidecar at %s refused a poll "
                          "(%s); trying again next step", self.engine_id, self.tp_rank,
                          self.socket, e)
        out.finished_sending.update(self._sends_ended)
        self._sends_ended.clear()
        early, self._early = self._early, []
        for c in [*early, *items]:
            self._uncertain.discard(c.request_id)
            if c.request_id in self._holding:
                self._sent(c, out)
            elif c.request_id in self._reading:
                self._received(c, out)
            else:
                log.debug("kvsidecar: completion for unknown request %s (%s)", c.request_id,
                          c.kind)
        return out

    def _sent(self, c: Completion, out: KVConnectorTransferResults) -> None:
        self._holding.discard(c.request_id)
        self._hold_blocks.pop(c.request_id, None)
        if c.kind == "expired":
            self.stats.record_kv_expired_req()
        out.finished_sending.add(c.request_id)

    def _received(self, c: Completion, out: KVConnectorTransferResults) -> None:
        """A read's outcome, in vLLM's NIXL terms: a failed read is a failed
        transfer (finished; with one KV-cache group its blocks are reported
        invalid and vLLM keeps the valid prefix, with several it is also
        failed); a failed notify-only read (a full prefix hit, an abort) is a
        failed notification."""
        job, t0, post_s = self._reading.pop(c.request_id)
        released = c.request_id in self._released
        self._released.discard(c.request_id)
        if c.kind == "received":
            if job.awaited:  # else notify-only: the scheduler awaits nothing
                self._record_transfers(c, time.perf_counter() - t0, post_s)
                out.finished_recving.add(c.request_id)
            return
        if released:
            out.finished_recving.add(c.request_id)  # the scheduler aborted it; blocks free
            return
        if not job.awaited:
            # The KV is local, nothing to redo; P frees its blocks at its lease.
            self.stats.record_failed_notification()
            log.error("kvsidecar: request %s: telling the prefill side that it may free its "
                      "blocks failed (%s: %s); it frees them when its hold runs out",
                      c.request_id, c.kind, c.reason)
            return
        self.stats.record_failed_transfer()
        out.finished_recving.add(c.request_id)
        bad = c.invalid_block_ids or job.local_block_ids
        if self.one_group and any(bad):
            # One group: the blocks the sidecar names are reported alone, so vLLM
            # keeps the request's valid prefix (its local prefix-cache hit and any
            # page before the first bad one) and recomputes from there.
            self._invalid.update(b for g in bad for b in g if b != NULL_BLOCK)
        else:
            # vLLM 0.33 maps block-level errors to requests for one group only;
            # hybrid configs take failed_recving (the whole request recomputes).
            out.failed_recving.add(c.request_id)
        log.error("kvsidecar: request %s: its KV read failed (%s: %s); vLLM recomputes it",
                  c.request_id, c.kind, c.reason)

    def _record_transfers(self, c: Completion, seen_s: float, post_s: float) -> None:
        """vLLM's NIXL semantics: one successful transfer per remote rank read
        from, with the sidecar's timings for it. A sidecar before protocol minor
        3 reports none: then one per read, timed as the engine saw it (read
        request to the poll that returned it)."""
        data = self.stats.data
        if c.transfers:
            for t in c.transfers:
                data["transfer_duration"].append(t.xfer_s)
                data["post_duration"].append(t.post_s)
                data["bytes_transferred"].append(t.nbytes)
                data["num_descriptors"].append(t.descriptors)
        elif c.nbytes:
            data["transfer_duration"].append(seen_s)
            data["post_duration"].append(post_s)
            data["bytes_transferred"].append(c.nbytes)
            data["num_descriptors"].append(c.descriptors)

    def new_address(self) -> KvSidecarAddresses | None:
        """This rank's sidecar address once it changed (registered again), once."""
        if not self._unpublished or self.handshake is None:
            return None
        self._unpublished = False
        return KvSidecarAddresses({self.tp_rank: self.handshake.address},
                                  {self.tp_rank: self.handshake.hold_key})

    def load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def take_stats(self) -> NixlKVConnectorStats | None:
        if self.stats.is_empty():
            return None
        out: NixlKVConnectorStats = self.stats.clone_and_reset()
        return out

    def shutdown(self) -> None:
        if self._keepalive is not None:
            self._keepalive.close()
        # A dead sidecar must not stall exit.
        self.client.timeout_s = min(self.client.timeout_s, 2.0)
        with contextlib.suppress(SidecarError):
            # Drain: requests held for decode but not yet read are still served from
            # the sidecar's memory after this process exits, then freed.
            self.client.deregister(self.engine_id, "drain")
        self.client.close()
        for r in self.regions:
            r.close()
        if self._pool is not None and self._pool.region is not None:
            self._pool.region.unlink()
        if self._kvpool is not None:
            self._kvpool.region.close()  # the sidecar keeps (or freed) its own


_ONE_RANK = " (one sidecar serves one rank of an engine: give every tp rank its own)"
_HOST_MEMORY = ("shm", "memfd")
_GPU_MEMORY = ("cuda_vmm", "cuda_malloc")


def _memory_for(device: str, memory: str | None) -> MemoryKind:
    """Where the KV cache lives, checked at start-up against the worker's device.

    CPU: ``memfd`` (default; a reservation the sidecar allocates and owns,
    the same path as on a GPU) or ``shm`` (POSIX shared memory the connector
    creates, registered in attach mode). GPU: only a sidecar reservation of
    GPU memory (``cuda_vmm`` or ``cuda_malloc``), and only when asked for: the
    path runs on CPU here and is untested with a GPU.
    """
    if device == "cpu":
        if memory in (None, *_HOST_MEMORY):
            return "memfd" if memory is None else memory  # type: ignore[return-value]
        raise UnsupportedConfig(f"memory {memory!r} is GPU memory but this vLLM worker runs on "
                                f"the CPU; use one of {_HOST_MEMORY}")
    if memory in _GPU_MEMORY:
        return memory  # type: ignore[return-value]
    raise UnsupportedConfig(
        f"kvsidecar on a {device!r} worker needs its KV cache in GPU memory the sidecar "
        f"allocates: set kv_connector_extra_config \"memory\" to one of {_GPU_MEMORY} "
        "(not yet run with vLLM on a GPU; see the README, 'Use it with vLLM')")


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        else:
            yield from _tensors(v)


def _tp_rank(vllm_config: VllmConfig) -> int:
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group)
    except (AssertionError, AttributeError, RuntimeError):
        # No distributed state (a unit test, or a single process): the
        # parallel config's rank is this worker's.
        pc = vllm_config.parallel_config
        return int(pc.rank) % int(pc.tensor_parallel_size)


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float8_e4m3fn: "fp8", torch.int8: "int8", torch.uint8: "uint8"}


def _hf_int(cfg: object, names: Sequence[str]) -> int | None:
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int):
            return v
    return None


def layout_for(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
               kernel_block_size: int | None = None) -> VllmLayout:
    """The kvsidecar layout of this rank, from vLLM's objects; refuses at start-up."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    model_config = vllm_config.model_config
    assert model_config is not None
    hf = model_config.hf_text_config
    model = str(model_config.model)
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise UnsupportedConfig(
            f"model {model}: pipeline_parallel_size "
            f"{vllm_config.parallel_config.pipeline_parallel_size} is not supported by "
            "kvsidecar (one sidecar per tp rank of a single pipeline stage); use tp only, "
            "as NixlConnector's pull mode requires for hybrid models")
    groups: list[GroupSpec] = []
    for g in kv_cache_config.transfer_groups:
        spec = g.kv_cache_spec
        kind = _group_kind(spec, model)
        layers = tuple(g.layer_names)
        if kind == "attention":
            groups.append(_attention_group(spec, layers, model_config, model,
                                           kernel_block_size))
        else:
            groups.append(_state_group(spec, layers, hf, tp))
    tensors = [TensorPlacement(tuple(t.layers), t.offset, t.layer_stride, t.block_stride,
                               t.host_resident) for t in kv_cache_config.kv_cache_tensors]
    dtype = _DTYPE_NAMES.get(model_config.dtype, str(model_config.dtype))
    return build_layout(model=str(model_config.model), tp_size=tp,
                        num_blocks=kv_cache_config.num_blocks, tensors=tensors, groups=groups,
                        dtype=dtype)


def _attention_group(spec: Any, layers: tuple[str, ...], model_config: Any, model: str,
                     kernel_block_size: int | None) -> AttentionGroupSpec:
    """Full attention, MLA (one latent per token, replicated over tp) or
    sliding window; refuses quantised, packed or sparse (DeepSeek-V3.2/V4) pages."""
    if getattr(spec, "kv_quant_mode", 0) or spec.num_head_slots is not None \
            or spec.state_content_bytes is not None or spec.tokens_per_state != 1:
        raise UnsupportedConfig(f"model {model}: quantised, packed or compressed attention KV "
                                f"pages ({type(spec).__name__}) are not supported by kvsidecar")
    latent = type(spec) is MLAAttentionSpec
    if latent and (spec.model_version is not None or spec.topk_buffer_width is not None):
        raise UnsupportedConfig(f"model {model}: sparse MLA ({spec.model_version or 'top-k'}) "
                                "is not supported by kvsidecar; dense MLA is")
    window = int(spec.sliding_window) if type(spec) is SlidingWindowSpec else 0
    total = 1 if latent else model_config.get_total_num_kv_heads()
    return AttentionGroupSpec(layers, spec.block_size, kernel_block_size or spec.block_size,
                              spec.num_kv_heads, total, spec.head_size, spec.head_size_v,
                              spec.dtype.itemsize, spec.page_size_bytes, window, latent)


def _state_group(spec: Any, layers: tuple[str, ...], hf: object, tp: int) -> GroupSpec:
    """A recurrent-state group by its Mamba type: Mamba2, GDN or Mamba1."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as T

    builders: dict[Any, Callable[..., GroupSpec]] = {
        T.MAMBA2: _mamba_group, T.GDN_ATTN: _gdn_group, T.MAMBA1: _mamba1_group}
    build = builders.get(spec.mamba_type)
    if build is None:
        raise UnsupportedConfig(f"Mamba type {spec.mamba_type} is not supported by kvsidecar "
                                "(Mamba1, Mamba2 and GDN are)")
    group: GroupSpec = build(spec, layers, hf, tp)
    return group


def _mamba1_group(spec: Any, layers: tuple[str, ...], hf: object, tp: int
                  ) -> Mamba1GroupSpec:
    conv, temporal = _state_shapes(spec, "Mamba1", temporal_dims=2)
    total = _hf_int(hf, ("intermediate_size_mamba",))
    if total is None:
        expand, hidden = _hf_int(hf, ("mamba_expand", "expand")), _hf_int(hf, ("hidden_size",))
        total = expand * hidden if expand and hidden else conv[0] * tp
    return Mamba1GroupSpec(layers, (conv[0], conv[1]), (temporal[0], temporal[1]),
                           spec.dtypes[0].itemsize, spec.dtypes[1].itemsize, total,
                           spec.page_size_bytes)


def _state_shapes(spec: Any, what: str, temporal_dims: int = 3
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv, temporal) shapes of a recurrent state in the DS conv layout."""
    from vllm import envs

    if envs.VLLM_SSM_CONV_STATE_LAYOUT != "DS":
        raise UnsupportedConfig("kvsidecar needs the DS conv-state layout: set "
                                "VLLM_SSM_CONV_STATE_LAYOUT=DS on P and D")
    if len(spec.shapes) != 2:
        raise UnsupportedConfig(f"{what} state with {len(spec.shapes)} arrays (expected conv "
                                "and temporal)")
    conv, temporal = (tuple(int(d) for d in s) for s in spec.shapes)
    if len(conv) != 2 or len(temporal) != temporal_dims:
        raise UnsupportedConfig(f"{what} state shapes {spec.shapes} are not (conv_dim, rows), "
                                f"and a {temporal_dims}-d temporal state")
    return conv, temporal


def _gdn_group(spec: Any, layers: tuple[str, ...], hf: object, tp: int) -> GdnGroupSpec:
    conv, temporal = _state_shapes(spec, "GDN")
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim")
    vals = [_hf_int(hf, (n,)) for n in names]
    if any(v is None for v in vals):
        raise UnsupportedConfig(f"GDN layers, but the model config lacks {list(names)}")
    nk, nv, hk, hv = (int(v) for v in vals if v is not None)
    return GdnGroupSpec(layers, (conv[0], conv[1]), (temporal[0], temporal[1], temporal[2]),
                        spec.dtypes[0].itemsize, spec.dtypes[1].itemsize, nk, nv, hk, hv,
                        spec.page_size_bytes)


def _mamba_group(spec: Any, layers: tuple[str, ...], hf: object, tp: int) -> Mamba2GroupSpec:
    conv, temporal = _state_shapes(spec, "Mamba2")
    heads, head_dim, d_state = temporal
    n_groups = _hf_int(hf, ("n_groups", "mamba_n_groups"))
    num_heads = _hf_int(hf, ("mamba_num_heads", "mamba_n_heads"))
    if n_groups is None:
        n_groups = (conv[0] - heads * head_dim) // (2 * d_state) * tp
    if num_heads is None:
        num_heads = heads * tp
    return Mamba2GroupSpec(layers, (conv[0], conv[1]), (heads, head_dim, d_state),
                           spec.dtypes[0].itemsize, spec.dtypes[1].itemsize, n_groups,
                           num_heads, spec.page_size_bytes)


# --------------------------------------------------------------------------
# The connector vLLM instantiates
# --------------------------------------------------------------------------


class KvSidecarConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by the rank's kvsidecar (pull: D reads from P)."""

    #: the prefix-cache hits it delivers come from a peer engine, as NixlConnector's
    #: (vLLM labels them ``p2p`` in its connector prefix-cache metrics)
    _cache_hit_source = CacheHitSource.P2P

    @property
    def requires_kv_delivery(self) -> bool:
        return bool(self._kv_transfer_config.is_kv_producer)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kt = vllm_config.kv_transfer_config
        assert kt is not None
        if kt.engine_id is None:
            raise UnsupportedConfig("kv_transfer_config.engine_id is unset")
        self.settings = Settings.from_extra(dict(kt.kv_connector_extra_config or {}))
        self.scheduler: _SchedulerSide | None = None
        self.worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = _SchedulerSide(vllm_config, kv_cache_config, self.settings)
            # Refuse unsupported layouts in the scheduler process too: start-up, not
            # the first request.
            layout_for(vllm_config, kv_cache_config, self.settings.kernel_block_size)
        else:
            self.worker = _WorkerSide(vllm_config, kv_cache_config, self.settings)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBHNC"  # layer-outermost, heads before tokens (LAYOUT.md: HND)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False

    # ------------------------------------------------------------ scheduler side

    def _sched(self) -> _SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("scheduler-side method called on a worker connector")
        return self.scheduler

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_meta(scheduler_output.preempted_req_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        sched = self._sched()
        sched.update_addresses(connector_output.kv_connector_worker_meta)
        sched.update_connector_output(connector_output.finished_recving)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        self._sched().set_handshakes(metadata)

    # ------------------------------------------------------------ worker side

    def _work(self) -> _WorkerSide:
        if self.worker is None:
            raise RuntimeError("worker-side method called on a scheduler connector")
        return self.worker

    def get_mem_pool_context(self) -> contextlib.AbstractContextManager[Any]:
        return self._work().mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._work().handshake

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KvSidecarMetadata)
        self._work().preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvSidecarMetadata)
        self._work().start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Reads complete between steps (asynchronous loads), never within a layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing to save: D pulls from P's blocks, which P holds."""

    def wait_for_save(self) -> None:
        """Nothing to save (pull)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self._work().results()
        return r.finished_sending, r.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._work().results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().load_errors()

    def get_kv_connector_stats(self) -> NixlKVConnectorStats | None:
        return self.worker.take_stats() if self.worker is not None else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.new_address() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> NixlKVConnectorStats | None:
        return NixlKVConnectorStats(data=data) if data is not None else NixlKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: Any,
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> Any:
        return NixlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
