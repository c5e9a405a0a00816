"""What vLLM's GPU model runner would register and what its GPU worker would measure, without a GPU.

Runs inside vLLM's EngineCore process (imported by `worker.py`): stdlib, vllm, torch and
`kvprobe.theory` only.

Two answers, each a copy of the real code path it replaces (vLLM 0.33.0):

* `kv_cache_spec` — one `KVCacheSpec` per attention layer, as the layers' own `get_kv_cache_spec`
  return them on a CUDA GPU: `Attention` (model_executor/layers/attention/attention.py L611-680)
  for standard attention, `MLAAttention` (layers/attention/mla_attention.py L1371-1400) for MLA,
  `DeepseekV32IndexerCache` (models/deepseek_v2.py L638-670, sized at L731-735) for the DSA
  indexer. A hybrid model (sliding-window, chunked-local, Gated DeltaNet layers) registers the
  specs `kvprobe.theory.vllm.hybrid.kv_cache_spec.vllm_layer_specs` computes, turned into vLLM's objects by
  `to_vllm_spec` — the one place kvprobe's layer specs become vLLM spec objects (the planner
  program `kvplan.py` uses it too). vLLM's own planner then groups them, sizes the pool and
  prints the capacity line.
* `available_kv_bytes` — `Worker.determine_available_memory` (v1/worker/gpu_worker.py L641-820):
  `--kv-cache-memory-bytes` exactly when given, else requested (ceil(total x
  gpu_memory_utilization), v1/worker/utils.py L716-726) minus weights, activation peak, non-torch
  memory and the CUDA-graph estimate. A GPU measures those four; kvprobe's ledger estimates them,
  and this calls the ledger's own split (`kvprobe.theory.vllm.budget.vllm_memory_split`) under the
  rules of the vLLM release it runs in, so that `reported_capacity` compares vLLM's planner with
  kvprobe's ledger on one formula.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch
from vllm import __version__ as VLLM_VERSION
from vllm.config import VllmConfig
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvprobe.errors import ConfigError
from kvprobe.targets.shadow.vllm import compat
from kvprobe.theory.model.geometry import ModelGeometry, geometry_from_config, weight_bytes
from kvprobe.theory.model.layers import LINEAR
from kvprobe.theory.vllm import budget
from kvprobe.theory.vllm.hybrid.kv_cache_spec import VllmOptions, release_options, vllm_layer_specs
from kvprobe.theory.vllm.releases import default_block_size, window_rules

INDEXER_QUANT_BLOCK = 128  # Indexer.quant_block_size (deepseek_v2.py L724): one fp32 scale per 128
# `layer_types` spellings that keep a full KV cache: vLLM's _ATTENTION_LAYER_TYPES (config/model.py
# L112-122; sparse attention still caches every token) plus the older "attention".
FULL_ATTENTION_TYPES = frozenset({"attention", "full_attention", "indexed_attention", "deepseek_sparse_attention",
                                  "qwen_sparse_attention"})


class UnsupportedModelError(ValueError):
    """The model has a layer kind this worker cannot describe as the GPU runner would."""


_ATTENTION = {"FullAttentionSpec": FullAttentionSpec, "SlidingWindowSpec": SlidingWindowSpec,
              "ChunkedLocalAttentionSpec": ChunkedLocalAttentionSpec}


def to_vllm_spec(d: dict) -> KVCacheSpec:
    """One `theory.vllm.hybrid.kv_cache_spec.VllmLayerSpec` (as a dict: its fields are the spec classes' own) -> the
    vLLM spec object (kv_cache_interface.py; Gated DeltaNet: layers/mamba/abstract.py L72-91)."""
    if d["spec"] == "MambaSpec":
        return MambaSpec(
            block_size=d["block_size"], shapes=tuple(tuple(s) for s in d["shapes"]),
            dtypes=tuple(getattr(torch, t) for t in d["dtypes"]),
            page_size_padded=d["page_size_padded"], mamba_type=compat.mamba_type(d["mamba_type"]),
            mamba_cache_mode=d["mamba_cache_mode"], **compat.mamba_fields(d))  # the release's fields (compat.py)
    cls = _ATTENTION[d["spec"]]
    kw = dict(block_size=d["block_size"], num_kv_heads=d["num_kv_heads"], head_size=d["head_size"],
              dtype=getattr(torch, d["dtype"]), **compat.quant_fields(d["cache_dtype"]))
    kw.update(compat.attention_fields(d["spec"], d["head_size_v"]))  # the release's value-head field
    if cls is SlidingWindowSpec:
        kw["sliding_window"] = d["sliding_window"]
    if cls is ChunkedLocalAttentionSpec:
        kw["attention_chunk_size"] = d["attention_chunk_size"]
    return cls(**kw)


def to_vllm_specs(specs: list[dict]) -> dict[str, KVCacheSpec]:
    return {d["name"]: to_vllm_spec(d) for d in specs}


@dataclass(frozen=True)
class Layout:
    """The attention layers of this worker's pipeline stage, as the GPU model would build them."""

    mla: bool
    layers: range  # this rank's decoder layers (get_layers_start_end_indices)
    indexer_layers: tuple[int, ...]  # layers that own a DSA indexer cache
    hybrid: ModelGeometry | None = None  # a hybrid model: its geometry (layer kinds) as kvprobe reads it


def _unsupported_kind(vllm_config: VllmConfig) -> str | None:
    """The first layer kind kvprobe does not model yet, or None for all-full-attention models."""
    mc = vllm_config.model_config
    text = mc.hf_text_config
    if mc.is_attention_free:
        return "attention-free layers (no KV cache)"
    if mc.is_hybrid:
        return "hybrid layers (mamba / linear attention state)"
    if mc.get_sliding_window() is not None:
        return f"sliding-window attention (sliding_window={mc.get_sliding_window()})"
    if getattr(text, "attention_chunk_size", None):
        return f"chunked local attention (attention_chunk_size={text.attention_chunk_size})"
    kinds = getattr(mc.hf_config, "layer_types", None) or getattr(text, "layer_types", None)
    if kinds and any(k not in FULL_ATTENTION_TYPES for k in kinds):
        other = sorted({k for k in kinds if k not in FULL_ATTENTION_TYPES})
        return f"layer_types {', '.join(other)}"
    return None


def _dsa_indexer_layers(text_config, layers: range) -> tuple[int, ...]:
    """Layers that build a DSA indexer (and with it an indexer KV cache), deepseek_v2.py L1138-1168:
    every layer when the config has `index_topk`, thinned by `index_topk_freq` (offset
    `index_skip_topk_offset`, default 2) or by an explicit `index_topk_pattern` ("S" = skip).
    vLLM 0.33.0 does not read `indexer_types`."""
    if not hasattr(text_config, "index_topk"):
        return ()
    freq = getattr(text_config, "index_topk_freq", 1) or 1
    pattern = getattr(text_config, "index_topk_pattern", None)
    offset = getattr(text_config, "index_skip_topk_offset", 2)
    owners = []
    for i in layers:
        if pattern is None:
            skip = max(i - offset + 1, 0) % freq != 0
        else:
            skip = 0 <= i < len(pattern) and pattern[i] == "S"
        if not skip:
            owners.append(i)
    return tuple(owners)


def _geometry(vllm_config: VllmConfig) -> ModelGeometry:
    """kvprobe's reading of the model folder's config.json; a layer kind it does not know is an
    UnsupportedModelError naming the key (never a full-attention guess)."""
    mc = vllm_config.model_config
    try:
        return geometry_from_config(_config_json(mc.model), mc.model, dtype=str(mc.dtype).removeprefix("torch."),
                                    source=os.path.join(mc.model, "config.json"))
    except ConfigError as err:
        raise UnsupportedModelError(f"kvprobe's shadow worker cannot describe this model's KV cache: {err}") from err


def layout(vllm_config: VllmConfig) -> Layout:
    lay = _layout(vllm_config)
    # kinds whose specs some releases' fields do not take (compat.REFUSED)
    mamba = lay.hybrid is not None and lay.hybrid.layers.count(LINEAR) > 0
    kind = compat.MAMBA_KIND if mamba else compat.DSA_KIND if lay.indexer_layers else None
    reason = compat.refusal(kind) if kind else None  # a release whose spec fields kvprobe has not written
    if reason:
        raise UnsupportedModelError(reason)
    return lay


def _layout(vllm_config: VllmConfig) -> Layout:
    mc = vllm_config.model_config
    if not mc.is_attention_free:
        geom = _geometry(vllm_config)
        if geom.layers.hybrid:  # window, chunk and linear layers: kvprobe's hybrid layer specs
            start, end = mc.get_layers_start_end_indices(vllm_config.parallel_config)
            return Layout(False, range(start, end), (), geom)
    kind = _unsupported_kind(vllm_config)
    if kind is not None:
        raise UnsupportedModelError(
            f"kvprobe's shadow worker cannot describe this model's KV cache: it has {kind}; "
            "only full attention (MHA/GQA), MLA (with a DSA indexer) and the hybrid layer kinds "
            "kvprobe reads from config.json are modelled")
    start, end = mc.get_layers_start_end_indices(vllm_config.parallel_config)
    layers = range(start, end)
    indexers = _dsa_indexer_layers(mc.hf_text_config, layers) if mc.use_mla else ()
    return Layout(bool(mc.use_mla), layers, indexers)


def gpu_block_size(vllm_config: VllmConfig, asked: int | None) -> int:
    """The block size the GPU backend would run: --block-size when given (the launcher passes it,
    since the CPU platform may have overwritten it), else the release's default on a CUDA GPU for MLA
    and hybrid models (`default_block_size`: 64 for MLA; 16, or 64 from 0.34.0, otherwise) and the
    engine's resolved default for the others (`CacheConfig.DEFAULT_BLOCK_SIZE`: 16, 64 in 0.34.0, config/cache.py
    L185, L489; 0.33.0's and 0.34.0's CPU platform leave it, its `update_block_size_for_backend` finding no
    attention layer here; 0.18.1's, 0.25.1's and 0.26.0's set 128 when not given, cpu.py L165-166 in 0.18.1)."""
    if asked:
        return int(asked)
    mc = vllm_config.model_config
    if mc.use_mla or mc.is_hybrid:
        # MLA: the CPU platform forces 16 (cpu.py L290-297), a GPU never does: FlashMLA (Hopper) kernels run
        # 64-token blocks only (`get_supported_kernel_block_sizes`, v1/attention/backends/mla/), the ledger's
        # releases.MLA_BLOCK_SIZE. Hybrid: the CPU platform aligned
        # it to its own backend's page (cpu.py L546-570); the GPU starts from FlashAttention's default and the
        # hybrid specs align from there (theory/vllm/hybrid `hybrid_block_size`)
        return default_block_size(VLLM_VERSION, mla=bool(mc.use_mla))
    return vllm_config.cache_config.block_size


def attention_block_size(kv_cache_config, default: int) -> int:
    """The block size of the first attention group the planner formed (a Mamba group's may be
    max_model_len)."""
    for group in kv_cache_config.kv_cache_groups:
        if not isinstance(group.kv_cache_spec, MambaSpec):
            return group.kv_cache_spec.block_size
    return default


def kv_cache_spec(vllm_config: VllmConfig, block_size: int, capability: str | None = None) -> dict[str, KVCacheSpec]:
    """{layer name: spec}, one per attention layer (and per DSA indexer cache) of this rank; `capability`: the
    declared card's (None: a Hopper's, the ledger's default)."""
    lay = layout(vllm_config)
    if lay.hybrid is not None:
        return hybrid_kv_cache_spec(vllm_config, lay.hybrid, block_size, capability)
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    cache_dtype = cc.cache_dtype
    dtype = kv_cache_dtype_str_to_dtype(cache_dtype, mc)
    specs: dict[str, KVCacheSpec] = {}
    if not lay.mla:
        quant = compat.quant_fields(cache_dtype)
        heads = mc.get_num_kv_heads(vllm_config.parallel_config)
        head = mc.get_head_size()
        for i in lay.layers:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=block_size, num_kv_heads=heads, head_size=head, head_size_v=head,
                dtype=dtype, **quant)
        return specs
    text = mc.hf_text_config
    mla = compat.mla_fields(cache_dtype)  # the fields this release's MLA layer passes (compat.py)
    for i in lay.layers:
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=mc.get_head_size(), dtype=dtype, **mla,
            **(compat.dsa_leader_fields(getattr(text, "index_topk", None), i in lay.indexer_layers)
               if lay.indexer_layers else {}))
    d = getattr(text, "index_head_dim", 0)
    for i in lay.indexer_layers:  # DeepseekV32IndexerCache (deepseek_v2.py L658-666, sized at L731-735)
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=d + d // INDEXER_QUANT_BLOCK * 4, dtype=torch.uint8,
            **compat.indexer_fields())
    return specs


def hybrid_options(vllm_config: VllmConfig, block_size: int, geom: ModelGeometry,
                   capability: str | None = None) -> VllmOptions:
    """The settings a hybrid model's layer specs depend on, from the engine's config (after the
    worker put back what the CPU platform changed) and the declared card's compute capability."""
    cc, sc, pc = vllm_config.cache_config, vllm_config.scheduler_config, vllm_config.parallel_config
    rules = window_rules(VLLM_VERSION)
    return VllmOptions(cache_dtype=cc.cache_dtype, block_size=block_size, tp=pc.tensor_parallel_size,
                       pp=pc.pipeline_parallel_size, max_num_batched_tokens=sc.max_num_batched_tokens,
                       async_scheduling=bool(sc.async_scheduling), enable_prefix_caching=bool(cc.enable_prefix_caching),
                       mamba_cache_dtype=cc.mamba_cache_dtype, mamba_ssm_cache_dtype=cc.mamba_ssm_cache_dtype,
                       # what the release's GDN layer puts in its spec (a GPU layer's code, not run here), with
                       # --gdn-prefill-backend as the engine parsed it (engine/arg_utils.py L2865-2866 in 0.33.0)
                       **release_options(rules, geom, (vllm_config.additional_config or {}).get("gdn_prefill_backend"),
                                         capability))


def hybrid_kv_cache_spec(vllm_config: VllmConfig, geom: ModelGeometry, block_size: int,
                         capability: str | None = None) -> dict[str, KVCacheSpec]:
    """A hybrid model's layers as a CUDA GPU's runner registers them (`vllm_layer_specs`,
    theory/vllm/hybrid/kv_cache_spec.py); vLLM's planner groups them (and promotes the window layers itself when
    the hybrid manager is off)."""
    opts = hybrid_options(vllm_config, block_size, geom, capability)
    resolved = vllm_config.cache_config.mamba_cache_mode
    if geom.layers.count(LINEAR) and resolved != opts.mamba_cache_mode:
        # the engine's planner and scheduler read the resolved mode (kv_cache_interface.py MambaSpec
        # max_memory_usage_bytes, v1/core/sched/scheduler.py), the GPU layer writes it into its spec
        # (layers/mamba/abstract.py L73 in 0.27.1): specs of another mode would describe another engine
        raise UnsupportedModelError(
            f"kvprobe's shadow worker cannot describe this model's KV cache: vLLM {VLLM_VERSION} resolved "
            f"mamba_cache_mode {resolved!r}, and kvprobe writes Mamba specs for {opts.mamba_cache_mode!r} only")
    try:
        specs = vllm_layer_specs(geom, opts, max_model_len=vllm_config.model_config.max_model_len)
    except ConfigError as err:
        raise UnsupportedModelError(f"kvprobe's shadow worker cannot describe this model's KV cache: {err}") from err
    return to_vllm_specs([dataclasses.asdict(s) for s in specs])


@dataclass(frozen=True)
class MemoryPlan:
    """How the KV bytes were found, for the worker's log line."""

    kv_bytes: int
    source: str  # "kv_cache_memory_bytes" | "declared GPU" | "num_gpu_blocks_override"
    detail: str


def available_kv_bytes(vllm_config: VllmConfig, *, gpu_memory_bytes: int | None,
                       estimates: dict[str, int]) -> MemoryPlan:
    """Bytes for the KV cache, as the GPU worker's `determine_available_memory` would return them."""
    cc, sc = vllm_config.cache_config, vllm_config.scheduler_config
    if cc.kv_cache_memory_bytes:  # gpu_worker.py L654-681: exactly this, no profiling
        return MemoryPlan(int(cc.kv_cache_memory_bytes), "kv_cache_memory_bytes",
                          f"--kv-cache-memory-bytes {cc.kv_cache_memory_bytes}")
    if gpu_memory_bytes is None:
        if cc.num_gpu_blocks_override is not None:
            # The planner replaces the profiled bytes by override x bytes per block
            # (kv_cache_planning.py L1510-1531); what a GPU would have profiled is moot.
            return MemoryPlan(0, "num_gpu_blocks_override", "no GPU declared; the override sizes the pool")
        raise UnsupportedModelError(
            "the shadow worker has no GPU to profile: declare one (hardware.gpu_memory, or "
            "--gpu-memory on the console), or pass --kv-cache-memory-bytes or --num-gpu-blocks-override")
    pc = vllm_config.parallel_config
    geom = _geometry(vllm_config)
    weights = weight_bytes(geom, tp=pc.tensor_parallel_size, pp=pc.pipeline_parallel_size, engine="vllm")
    fraction = compat.gpu_memory_utilization(cc)  # 0.34.0's field may be None: the engine's resolved value
    split = budget.vllm_memory_split(  # the ledger's own split, under the rules of the release running here
        geom, weights=weights, gpu_memory_bytes=gpu_memory_bytes, fraction=fraction,
        version=VLLM_VERSION, max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
        tp=pc.tensor_parallel_size, pp=pc.pipeline_parallel_size, estimates=estimates,
        enforce_eager=bool(vllm_config.model_config.enforce_eager))
    graph = split.cudagraph if split.cudagraph_subtracted else 0
    detail = (f"requested {split.requested} (vLLM {VLLM_VERSION}: {gpu_memory_bytes} x {fraction}) "
              f"- weights {split.weights} - other {split.other} - activation {split.activation} - cudagraph {graph}")
    return MemoryPlan(split.kv_pool, "declared GPU", detail)


def _config_json(folder: str) -> dict:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
        return json.load(fh)
