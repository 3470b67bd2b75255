"""Real model families for the connector tests: published configs, vLLM's own specs.

Each ``config.json`` below is the model's published Hugging Face config, with
two kinds of change, both to values the KV-cache specs do not depend on:

* fewer layers (``num_hidden_layers``, and the layer pattern cut to the same
  length, keeping at least one layer of every kind the model has): a spec is
  per layer and does not depend on how many there are;
* gpt-oss-20b without its ``quantization_config`` (MXFP4 expert weights):
  weights only, the KV cache is bf16 either way.

Gemma-3-4B is its text model (``Gemma3ForCausalLM``, ``gemma3_text``: the
``text_config`` of the published multimodal config): the vision tower holds
no KV cache.

The specs are vLLM's: :func:`build_specs` runs vLLM 0.33 in a subprocess on
its CPU platform, builds each model on the ``meta`` device (no weights, no
memory) and asks every attention / Mamba layer for its ``KVCacheSpec``, as
the model runner does. The subprocess keeps vLLM's distributed state and
platform choice out of the test process. The test process then groups the
specs and sizes the cache with vLLM's own ``get_kv_cache_configs``, with the
hybrid allocator on, as a GPU engine core would.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

from .harness import Engine, start_engine, vllm_config

# Published config.json values (layer counts cut as the module docstring says).
CONFIGS: dict[str, dict[str, Any]] = {
    # meta-llama/Meta-Llama-3-8B: dense GQA, 8 KV heads of 128. 32 layers -> 2.
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 2, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
    # deepseek-ai/DeepSeek-V2-Lite: MLA (kv_lora_rank 512 + rope 64 = one 576-wide
    # latent per token), MoE from layer 1. 27 layers -> 2 (one dense, one MoE).
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "attention_bias": False, "bos_token_id": 100000, "eos_token_id": 100001,
        "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1,
        "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
        "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 2,
        "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
        "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
        "v_head_dim": 128, "vocab_size": 102400, "tie_word_embeddings": False,
    },
    # google/gemma-3-4b-it text_config: 5 sliding (window 1024) : 1 global layers,
    # 4 KV heads of 256. 34 layers -> 6 (one whole pattern).
    "gemma-3-4b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 2560, "intermediate_size": 10240, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "num_hidden_layers": 6,
        "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rms_norm_eps": 1e-6,
        "vocab_size": 262208, "max_position_embeddings": 131072,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "bfloat16",
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    },
    # openai/gpt-oss-20b: MoE, alternating sliding (window 128) and full layers,
    # 8 KV heads of 64. 24 layers -> 2 (one of each).
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
        "num_key_value_heads": 8, "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"], "num_local_experts": 32,
        "num_experts_per_tok": 4, "sliding_window": 128, "vocab_size": 201088,
        "max_position_embeddings": 131072, "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn",
                         "truncate": False},
        "rms_norm_eps": 1e-05, "swiglu_limit": 7.0, "attention_bias": True,
        "initial_context_length": 4096, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "eos_token_id": 200002, "pad_token_id": 199999,
        "hidden_act": "silu",
    },
    # nvidia/NVIDIA-Nemotron-Nano-9B-v2: Mamba2 (128 heads of 80, 8 groups, d_state
    # 128) + GQA attention. 56 layers -> 4: pattern "M*M-" (Mamba, attention,
    # Mamba, MLP) instead of "M-M-M-MM-M-M-M*-...".
    "nemotron-nano-9b-v2": {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hidden_size": 4480, "intermediate_size": 15680, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "hybrid_override_pattern": "M*M-",
        "num_hidden_layers": 4, "mamba_num_heads": 128, "mamba_head_dim": 80, "n_groups": 8,
        "ssm_state_size": 128, "conv_kernel": 4, "expand": 2, "chunk_size": 128,
        "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "use_conv_bias": True,
        "use_bias": False, "mamba_proj_bias": False, "attention_bias": False,
        "rms_norm_eps": 1e-05, "residual_in_fp32": False, "vocab_size": 131072,
        "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "bos_token_id": 1,
        "eos_token_id": 12, "pad_token_id": 0, "tie_word_embeddings": False,
    },
    # ai21labs/Jamba-v0.1: Mamba1 (d_state 16, expand 2: 8192 channels) with one
    # attention layer in 8 (offset 4), MoE every other layer. 32 layers -> 5
    # (four Mamba1, the first attention layer).
    "jamba-v0.1": {
        "architectures": ["JambaForCausalLM"], "model_type": "jamba", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 5, "attn_layer_period": 8, "attn_layer_offset": 4,
        "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 16,
        "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_dt_rank": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
        "use_mamba_kernels": True, "vocab_size": 65536, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    # Qwen/Qwen3-Next-80B-A3B-Instruct: gated delta net (16 key / 32 value heads of
    # 128) with one full-attention layer in 4, MoE. 48 layers -> 4 (one interval).
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 2048, "intermediate_size": 5120, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 4,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 512,
        "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "partial_rotary_factor": 0.25,
        "rope_theta": 10000000, "rms_norm_eps": 1e-06, "vocab_size": 151936,
        "max_position_embeddings": 262144, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
}

HYBRID = {"nemotron-nano-9b-v2", "qwen3-next-80b-a3b", "jamba-v0.1"}
#: long enough for a prompt past gemma-3's 1024-token window; the rest stay short
#: (the hybrids' attention pages are padded to the Mamba state's MiBs)
MAX_MODEL_LEN = {"gemma-3-4b": 1536, "nemotron-nano-9b-v2": 128, "qwen3-next-80b-a3b": 128,
                 "jamba-v0.1": 128}
DEFAULT_MAX_LEN = 512

_SPECS_SCRIPT = r'''
import json, pickle, sys
import torch
from vllm.config import set_current_vllm_config
from vllm.config.vllm import get_layers_from_vllm_config
from vllm.distributed.parallel_state import (destroy_model_parallel,
    init_distributed_environment, initialize_model_parallel)
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.v1.worker.utils import customize_attention_spec
sys.path.insert(0, sys.argv[3])
from vllm_connector_families_cfg import spec_config
tp, rank, port = (int(a) for a in sys.argv[4:7])
out = {}
for i, (path, hybrid) in enumerate(json.loads(sys.argv[2])):
    cfg = spec_config(path, hybrid, tp)
    with set_current_vllm_config(cfg):
        if i == 0:
            init_distributed_environment(world_size=tp, rank=rank, local_rank=rank,
                distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        else:
            destroy_model_parallel()
        initialize_model_parallel(tp, 1)  # per model: MoE models get an EP group
        with torch.device("meta"):
            initialize_model(vllm_config=cfg)
    specs = {}
    for name, layer in get_layers_from_vllm_config(cfg, AttentionLayerBase).items():
        spec = layer.get_kv_cache_spec(cfg)
        if spec is not None and hasattr(spec, "num_kv_heads"):
            spec = customize_attention_spec(layer.get_attn_backend(), spec)
        if spec is not None:
            specs[name] = spec
    out[path] = specs
    cfg.compilation_config.static_forward_context.clear()
if rank == 0:
    with open(sys.argv[1], "wb") as f:
        pickle.dump(out, f)
'''

# The VllmConfig both processes build for a model (the spec depends on the cache
# config: block size, Mamba cache mode). Written next to the script so the
# subprocess imports it without importing the test package.
_CFG_MODULE = '''
from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig,
    SchedulerConfig, VllmConfig)

def spec_config(path, hybrid, tp, max_len=512):
    mc = ModelConfig(model=path, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                     max_model_len=max_len)
    cc = CacheConfig(block_size=16, enable_prefix_caching=not hybrid,
                     mamba_cache_mode="none")
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=max_len,
                         is_encoder_decoder=False, enable_chunked_prefill=True)
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                      device_config=DeviceConfig("cpu"),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp))
'''


def write_models(d: Path) -> dict[str, str]:
    """Each family's config.json in its own folder; name -> folder."""
    out = {}
    for name, cfg in CONFIGS.items():
        p = d / name
        p.mkdir(parents=True, exist_ok=True)
        (p / "config.json").write_text(json.dumps(cfg))
        out[name] = str(p)
    return out


def build_specs(models: dict[str, str], workdir: Path, tp: int = 1
                ) -> dict[str, dict[str, KVCacheSpec]]:
    """name -> {layer: KVCacheSpec} of one rank, as vLLM's CPU model runner
    reports them; at ``tp`` > 1 from ``tp`` processes that form vLLM's tp group
    (gloo), rank 0's (every rank's spec is the same)."""
    (workdir / "vllm_connector_families_cfg.py").write_text(_CFG_MODULE)
    script = workdir / "family_specs.py"
    script.write_text(_SPECS_SCRIPT)
    out = workdir / f"specs-tp{tp}.pkl"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
    args = json.dumps([[p, name in HYBRID] for name, p in models.items()])
    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(script), str(out), args, str(workdir),
                               str(tp), str(rank), str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for rank in range(tp)]
    errs = [p.communicate(timeout=900)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-3000:] for e in errs]
    with open(out, "rb") as f:
        by_path = pickle.load(f)
    return {name: by_path[p] for name, p in models.items()}


def family_config(name: str, model: str, role: str, engine_id: str, sockets: Sequence[str],
                  tp: int = 1) -> Any:
    """The harness's VllmConfig for a family, as a GPU engine core leaves it:
    hybrid allocator on (the test process has no platform that enables it),
    the connector's layout (LBHNC) resolved."""
    hybrid = name in HYBRID
    cfg = vllm_config(model, role, engine_id, tp, sockets, hybrid)
    cfg.model_config.max_model_len = MAX_MODEL_LEN.get(name, DEFAULT_MAX_LEN)
    cfg.scheduler_config.max_model_len = cfg.model_config.max_model_len
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    cfg.cache_config.kv_cache_layout = "LBHNC"
    return cfg


def family_kv_cache_config(cfg: Any, specs: dict[str, KVCacheSpec], num_blocks: int
                           ) -> KVCacheConfig:
    """vLLM's grouping and sizing for at least ``num_blocks`` blocks (and what one
    request of max_model_len needs)."""
    groups = get_global_kv_cache_groups(cfg, [specs])
    page = max(g.kv_cache_spec.page_size_bytes for g in groups)
    need = sum(g.kv_cache_spec.max_memory_usage_bytes(cfg) * len(g.layer_names)
               for g in groups)
    mem = max(need, num_blocks * page * len(specs))
    kcc: KVCacheConfig = get_kv_cache_configs(cfg, [copy.deepcopy(specs)], [mem], groups)[0]
    kcc.kv_cache_layout = "LBHNC"
    return kcc


def make_family_engine(name: str, model: str, specs: dict[str, KVCacheSpec], role: str,
                       engine_id: str, sockets: Sequence[str], num_blocks: int,
                       tp: int = 1) -> Engine:
    """One engine of a family: vLLM's KVCacheConfig, its allocation inside the
    connector's memory pool, the real Scheduler. ``tp`` > 1 only where a rank's
    specs are the tp-1 ones (MLA: one latent, every rank holds it whole)."""
    cfg = family_config(name, model, role, engine_id, sockets, tp)
    kcc = family_kv_cache_config(cfg, specs, num_blocks)
    # as vLLM's engine core: the block size is the smallest group's
    cfg.cache_config.block_size = min(g.kv_cache_spec.block_size for g in kcc.kv_cache_groups
                                      if g.kv_cache_spec.prefix_cacheable)
    # Kernel blocks as the backend cuts them: the group's block size (the CPU
    # backend's), one kernel block per page.
    kernel = [g.kv_cache_spec.block_size for g in kcc.kv_cache_groups]
    eng: Engine = start_engine(engine_id, cfg, kcc, kernel, tp)
    return eng
