"""The connector's scheduler side: decides reads, holds and releases; no I/O.

vLLM builds it in the scheduler process (role SCHEDULER). P: a request that
finished prefill gets a hold job and the ``kv_transfer_params`` its reader
needs (addresses, block ids, one hold token per rank). D: a request with
remote prefill gets a read job once its blocks are allocated; one admitted
but not yet read keeps P's holds alive (``Keep``). Each step's jobs go to the
workers as :class:`~.messages.KvSidecarMetadata`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import KVCacheConfig

from ...ipc import hold_token
from ...ipc.protocol import KeepItem, RemoteEngine
from .layout import UnsupportedConfig
from .messages import HoldJob, KvSidecarAddresses, KvSidecarHandshake, KvSidecarMetadata, ReadJob
from .settings import NULL_BLOCK, TOKEN_LIFE_S, Settings
from .specs import group_kind, window_blocks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def clip(block_ids: Sequence[Sequence[int]], kinds: Sequence[str],
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


class SchedulerSide:
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
        self.kinds = [group_kind(g.kv_cache_spec, model) for g in groups]
        self.block_sizes = [g.kv_cache_spec.block_size for g in groups]
        #: blocks a sliding-window group transfers (0: every block)
        self.window_blocks = [window_blocks(g.kv_cache_spec) for g in groups]
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
        blocks = clip(self.kv_cache_config.select_transfer_block_ids(list(block_ids)),
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
            local = clip(ids, self.kinds, self.spec_blocks, self.window_blocks)
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
