"""vLLM engines for the connector tests: the REAL v1 Scheduler, our connector on
both sides, KV memory allocated by vLLM's own ``allocate_kv_cache`` inside the
connector's memory-pool context, real sidecar processes.

What is not vLLM here is the model: a step "computes" by writing the LAYOUT.md
oracle's logical state into the P pages the scheduler allocated, and samples a
fixed token. Everything the connector sees (scheduler output, connector
metadata, block ids, KVConnectorOutput aggregated by vLLM's KVOutputAggregator)
is what a vLLM worker would hand it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvsidecar.integrations.vllm import KvSidecarConnector
from kvsidecar.sim.oracle import POISON
from kvsidecar.sim.oracle import Request as OracleRequest

BLOCK = 16
MAX_LEN = 2048
#: the forward context of a step in which no model runs: no attention metadata
#: (a connector that loads inside the forward pass, as vLLM's ExampleConnector,
#: then has nothing to do; ours ignores it)
NO_FORWARD = SimpleNamespace(attn_metadata=None, no_compile_layers={})
EOS = 2
init_none_hash(sha256)

# Model shapes: 2 attention layers, 2 KV heads of 16 (bf16). Hybrid adds 2
# Mamba2 layers: 4 heads x 8 dims, 2 groups, d_state 8, conv kernel 4, and has
# one KV head: replicated at tp 2, so an attention kernel block keeps its size
# while the Mamba state halves. vLLM then sizes the page as 2 kernel blocks
# (32 tokens) at tp 1 and 1 (16 tokens) at tp 2: P and D differ in sub_blocks,
# as Nemotron-H does in production (261 vs 131).
KV_HEADS, HYBRID_KV_HEADS, HEAD = 2, 1, 16
M_HEADS, M_HEAD_DIM, M_GROUPS, D_STATE, CONV_ROWS = 4, 8, 2, 8, 3


def write_model(d: Path, hybrid: bool) -> str:
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": HYBRID_KV_HEADS if hybrid else KV_HEADS,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "head_dim": HEAD,
    }
    if hybrid:  # read by the connector for the model totals of the Mamba2 state
        cfg.update(n_groups=M_GROUPS, mamba_num_heads=M_HEADS)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def vllm_config(model: str, role: str, engine_id: str, tp: int, sockets: Sequence[str],
                hybrid: bool, *, mamba_prefix_caching: bool = False,
                failure_policy: str = "recompute", batched_tokens: int = 4096,
                **extra: Any) -> VllmConfig:
    mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", seed=0)
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=batched_tokens,
                         max_model_len=MAX_LEN, is_encoder_decoder=False,
                         enable_chunked_prefill=True)
    # Mamba has prefix caching only in cache mode "align" (states kept at block
    # boundaries).
    if hybrid and mamba_prefix_caching:
        cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, mamba_cache_mode="align")
    else:
        cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=not hybrid)
    kt = KVTransferConfig(
        kv_connector="KvSidecarConnector", kv_connector_module_path="kvsidecar.integrations.vllm",
        kv_role=role, engine_id=engine_id, kv_load_failure_policy=failure_policy,
        kv_connector_extra_config={"sidecar_sockets": list(sockets), **extra},
    )
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                      kv_transfer_config=kt, device_config=DeviceConfig("cpu"),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp))


def kv_cache_config(tp: int, num_blocks: int, hybrid: bool,
                    mamba_cache_mode: str = "none") -> KVCacheConfig:
    """What vLLM's engine core would hand a rank: one backing buffer, layer-outermost."""
    heads = max(1, (HYBRID_KV_HEADS if hybrid else KV_HEADS) // tp)
    if not hybrid:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD,
                                 dtype=torch.bfloat16)
        page = spec.page_size_bytes
        layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
        return KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=2 * num_blocks * page, layers=layers,
                                            layer_stride=num_blocks * page, block_stride=page)],
            kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
        )
    mh, ng = M_HEADS // tp, max(1, M_GROUPS // tp)
    conv = (mh * M_HEAD_DIM + 2 * ng * D_STATE, CONV_ROWS)
    temporal = (mh, M_HEAD_DIM, D_STATE)
    mamba_bytes = conv[0] * conv[1] * 2 + mh * M_HEAD_DIM * D_STATE * 4
    kernel = heads * BLOCK * 2 * HEAD * 2
    attn_block = BLOCK * -(-mamba_bytes // kernel)  # vLLM: attention page >= mamba page
    attn = FullAttentionSpec(block_size=attn_block, num_kv_heads=heads, head_size=HEAD,
                             dtype=torch.bfloat16)
    page = attn.page_size_bytes
    mamba = MambaSpec(block_size=attn_block, shapes=(conv, temporal),
                      dtypes=(torch.bfloat16, torch.float32), page_size_padded=page,
                      mamba_type=MambaAttentionBackendEnum.MAMBA2,
                      mamba_cache_mode=mamba_cache_mode)
    attn_layers = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
    mamba_layers = ["model.layers.1.mixer", "model.layers.3.mixer"]
    place = {"size": 2 * num_blocks * page, "layer_stride": num_blocks * page,
             "block_stride": page}
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(layers=attn_layers, **place),
                          KVCacheTensor(layers=mamba_layers, **place)],
        kv_cache_groups=[KVCacheGroupSpec(attn_layers, attn),
                         KVCacheGroupSpec(mamba_layers, mamba)],
    )


@dataclass
class Engine:
    """One vLLM instance: a real Scheduler and one worker connector per tp rank."""

    name: str
    sched: Scheduler
    workers: list[KvSidecarConnector]
    kv_caches: list[dict[str, torch.Tensor]]
    aggregator: KVOutputAggregator
    hash_block: int
    fill: Callable[[Engine, Request], None] | None = None
    outputs: dict[str, list[Any]] = field(default_factory=dict)
    dirty: set[int] = field(default_factory=set)  # pages earlier reads wrote
    stats: list[Any] = field(default_factory=list)  # aggregated KV connector stats per step
    sched_stats: list[Any] = field(default_factory=list)  # SchedulerStats per step

    @property
    def connector(self) -> KvSidecarConnector:
        c = self.sched.connector
        assert isinstance(c, KvSidecarConnector)
        return c

    def buffers(self, rank: int) -> list[np.ndarray]:
        w = self.workers[rank].worker
        assert w is not None
        return [r.numpy() for r in w.regions]

    @property
    def layout(self) -> Any:
        w = self.workers[0].worker
        assert w is not None
        return w.vl.layout

    def layout_of(self, rank: int) -> Any:
        w = self.workers[rank].worker
        assert w is not None
        return w.vl.layout

    def block_ids(self, rid: str) -> tuple[list[int], ...]:
        return self.sched.kv_cache_manager.get_block_ids(rid)

    def step(self) -> Any:
        """One engine step, as vLLM's engine core and workers run it."""
        so = self.sched.schedule()
        outs: list[ModelRunnerOutput | None] = []
        if self.fill is not None:
            for new in so.scheduled_new_reqs:
                self.fill(self, self.sched.requests[new.req_id])
        req_ids = list(so.num_scheduled_tokens)
        # As vLLM's runner: a token is sampled once a request's prompt is all
        # computed; a partial prefill chunk samples nothing.
        sampled = [[] if self.sched.requests[r].is_prefill_chunk else [7] for r in req_ids]
        for w in self.workers:
            w.handle_preemptions(so.kv_connector_metadata)  # as vLLM's runner, first
            w.bind_connector_metadata(so.kv_connector_metadata)
            w.start_load_kv(NO_FORWARD)
            w.wait_for_save()
            r = w.get_transfer_results(set(so.finished_req_ids))
            kv_out = KVConnectorOutput(
                finished_sending=r.finished_sending or None,
                finished_recving=r.finished_recving or None,
                failed_recving=r.failed_recving,
                invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_stats=w.get_kv_connector_stats(),
                kv_connector_worker_meta=w.build_connector_worker_meta(),
            )
            w.clear_connector_metadata()
            outs.append(ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled, logprobs=None,
                prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv_out))
        agg = self.aggregator.aggregate(outs)
        assert agg is not None
        if agg.kv_connector_output and agg.kv_connector_output.kv_connector_stats:
            self.stats.append(agg.kv_connector_output.kv_connector_stats)
        eco = self.sched.update_from_output(so, agg)
        for client_outs in eco.values():
            if client_outs.scheduler_stats is not None:
                self.sched_stats.append(client_outs.scheduler_stats)
            for o in client_outs.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)
        return so, agg

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()


def make_engine(name: str, model: str, role: str, tp: int, sockets: Sequence[str],
                num_blocks: int, hybrid: bool, *, mamba_prefix_caching: bool = False,
                memory: str | None = None, failure_policy: str = "recompute",
                batched_tokens: int = 4096, extra: dict[str, Any] | None = None,
                draft_tokens: int = 0, **settings: Any) -> Engine:
    """``extra`` and ``settings``: more kv_connector_extra_config keys (``memory``
    has its own argument). ``draft_tokens``: speculative decoding with a draft
    model (the same config; nothing runs it), so the scheduler reserves that many
    lookahead slots."""
    extra = dict(extra or {}) | settings | ({} if memory is None else {"memory": memory})
    cfg = vllm_config(model, role, name, tp, sockets, hybrid,
                      mamba_prefix_caching=mamba_prefix_caching, failure_policy=failure_policy,
                      batched_tokens=batched_tokens, **extra)
    if draft_tokens:
        cfg.speculative_config = SpeculativeConfig(
            method="draft_model", model=model, num_speculative_tokens=draft_tokens,
            target_model_config=cfg.model_config, target_parallel_config=cfg.parallel_config)
    mode = "align" if hybrid and mamba_prefix_caching else "none"
    kcc = kv_cache_config(tp, num_blocks, hybrid, mode)
    # The attention backend's kernel blocks: BLOCK tokens, whatever the page.
    kernel = [BLOCK if isinstance(g.kv_cache_spec, FullAttentionSpec)
              else g.kv_cache_spec.block_size for g in kcc.kv_cache_groups]
    return start_engine(name, cfg, kcc, kernel, tp)


def start_engine(name: str, cfg: VllmConfig, kcc: KVCacheConfig, kernel: list[int],
                 tp: int, worker_cls: Any = KvSidecarConnector, engine_cls: Any = Engine
                 ) -> Any:
    """What vLLM's engine core and workers do at start-up: per rank a worker
    connector (``worker_cls``), the KV cache allocated by vLLM inside its memory
    pool (kernel blocks ``kernel`` per group) and registered; the real
    Scheduler; the ranks' handshake metadata handed to it. Pages start poisoned."""
    workers, caches = [], []
    for rank in range(tp):
        wcfg = copy.deepcopy(cfg)
        wcfg.parallel_config.rank = rank
        conn = worker_cls(wcfg, KVConnectorRole.WORKER, copy.deepcopy(kcc))
        with conn.get_mem_pool_context():
            kv = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC, kernel)
        conn.register_kv_caches(kv)
        workers.append(conn)
        caches.append(kv)
    cfg.cache_config.num_gpu_blocks = kcc.num_blocks
    block, hash_block = resolve_kv_cache_block_sizes(kcc, cfg)  # as vLLM's engine core
    sched = Scheduler(vllm_config=cfg, kv_cache_config=kcc,
                      structured_output_manager=StructuredOutputManager(cfg),
                      block_size=block, hash_block_size=hash_block, log_stats=True)
    meta = {}
    for rank, w in enumerate(workers):
        hs = w.get_handshake_metadata()
        assert hs is not None
        meta[rank] = hs
    sched.connector.set_xfer_handshake_metadata(meta)  # what the engine core does
    eng = engine_cls(name, sched, workers, caches, KVOutputAggregator(tp), hash_block)
    for rank in range(tp):
        for b in eng.buffers(rank):
            b[:] = POISON
    return eng


def request(eng: Engine, rid: str, tokens: int, params: dict[str, Any] | None,
            max_tokens: int = 4, seed: int = 1) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=rid, prompt_token_ids=[(seed * 31 + i) % 997 + 3
                                                    for i in range(tokens)],
                  sampling_params=sp, pooling_params=None, mm_features=None,
                  block_hasher=get_request_block_hasher(eng.hash_block, sha256))
    req.kv_transfer_params = params
    return req


def oracle_fill(seed_of: Callable[[str], int]) -> Callable[[Engine, Request], None]:
    """P's "model": write the oracle's state for every token P computes."""
    from kvsidecar.sim.oracle import fill_shard

    def fill(eng: Engine, req: Request) -> None:
        # The model writes a Mamba layer's new state into the group's last slot
        # (the one before it held the previous state and is nulled afterwards).
        kinds = [g.kv_cache_spec.__class__.__name__ for g in eng.sched.kv_cache_config
                 .kv_cache_groups]
        ids = [[b for b in g if b != 0] for g in eng.block_ids(req.request_id)]
        ids = [g[-1:] if k == "MambaSpec" else g for g, k in zip(ids, kinds)]
        logical = OracleRequest(seed_of(req.request_id), req.num_prompt_tokens)
        for rank in range(len(eng.workers)):
            fill_shard(eng.buffers(rank), eng.layout_of(rank), rank, ids, logical)

    return fill


def failed_reads(out: Any) -> set[str]:
    """The requests a worker output reports as failed reads: those in
    ``failed_recving`` and, when it names invalid blocks, those finished with it
    (with one KV-cache group the connector reports a failed read's blocks
    invalid and no ``failed_recving``, so that vLLM keeps the valid prefix).
    Meant for steps in which only the read under test finishes."""
    if out is None:
        return set()
    failed = set(out.failed_recving or ())
    if out.invalid_block_ids:
        failed |= set(out.finished_recving or ())
    return failed
