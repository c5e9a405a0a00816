"""Model geometry from a Hugging Face config.json: KV bytes per token and weight bytes per rank.

The KV layouts are the engines' own (vLLM 0.33.0 `v1/kv_cache_interface.py`,
`layers/attention/mla_attention.py`; SGLang 0.5.23 `model_executor/pool_configurator.py`):

* standard attention (MHA/GQA): K and V per KV head, ``kv_heads_per_rank = max(1, kv_heads // tp)``
  (both engines replicate KV heads when TP exceeds them);
* MLA: one latent of ``kv_lora_rank + qk_rope_head_dim`` per token per layer, held whole on every
  TP rank, no factor 2; ``fp8_ds_mla`` packs it into 656 bytes (512 fp8 + 4 fp32 scales + 64 bf16
  rope, the general rule being ``r + r//128*4 + rope*2``);
* DSA indexer (configs with ``index_head_dim``): an fp8 key plus one fp32 scale per 128 elements,
  132 bytes for a 128-dim key, only on layers marked ``"full"`` in ``indexer_types`` (all layers
  when the list is absent); its dtype does not follow ``--kv-cache-dtype``.

Layer kinds (full, sliding-window, chunked-local, linear attention) come from `layers.py`; the
parameter groups from `weights.py`; the presets and config loading from `presets.py`
(re-exported here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvprobe.errors import ConfigError
from kvprobe.theory.model.layers import ATTENTION_KINDS, LayerKinds, layer_kinds
from kvprobe.theory.model.mxfp4 import DEFAULT_GPU_ARCH, engine_expert_bytes, sink_bytes
from kvprobe.theory.model.presets import PRESETS, list_presets, load_model_config  # noqa: F401 (re-exported)
from kvprobe.theory.model.quant import linear_quant
from kvprobe.theory.model.sizes import DTYPE_BYTES
from kvprobe.theory.model.vision import vision_parts
from kvprobe.theory.model.weights import (
    PHI_LAYOUT,
    Parts,
    WeightPart,
    attention_parts,
    dense_layer_ids,
    indexer_parts,
    mlp_parts,
    rope_cache_parts,
)

_FP8_KV = ("fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", *_FP8_KV, "fp8_ds_mla")
_SCALE_BLOCK = 128  # elements per fp32 scale: DSA indexer keys and fp8_ds_mla latents
# Defaults of transformers' config classes for keys a published config.json leaves out (the engines
# read config.json through these classes): Gemma3TextConfig (gemma3/configuration_gemma3.py L74-82,
# transformers 5.20) — google/gemma-3-27b-it names neither its vocabulary nor its context.
# Gemma3TextConfig ties lm_head to the embeddings by default (L89 `tie_word_embeddings: bool = True`), and
# vLLM 0.33.0 then ties them (models/gemma3.py L398-399): one vocabulary-wide matrix, not two.
# GemmaConfig and Gemma2Config tie them by default too, and vLLM's gemma.py and gemma2.py assert that every
# checkpoint does (0.18.1 gemma.py L385-386, logits from embed_tokens L416; gemma2.py L391-392): google/gemma-7b's
# config.json names no tie_word_embeddings. All three classes default head_dim to 256, not hidden / heads
# (transformers 5.20 configuration_gemma.py L73, configuration_gemma2.py L74, configuration_gemma3.py L80): 3840 / 16
# = 240 would be wrong for a Gemma-3 12B config that leaves it out.
_GEMMA = {"head_dim": 256, "tie_word_embeddings": True}
_CLASS_DEFAULTS = {"gemma3_text": {**_GEMMA, "vocab_size": 262_208, "max_position_embeddings": 131_072},
                   "gemma": {**_GEMMA, "vocab_size": 256_000}, "gemma2": {**_GEMMA, "vocab_size": 256_000}}


@dataclass(frozen=True)
class ModelGeometry:
    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    attention: str  # "gqa" | "mla"
    kv_lora_rank: int
    qk_rope_head_dim: int
    indexer_layers: int  # 0 without a DSA indexer
    indexer_head_dim: int
    indexer_layer_ids: tuple[int, ...]
    dtype: str
    dtype_bytes: int
    weight_dtype_bytes: int
    quantized_fp8: bool
    param_count: int
    max_position_embeddings: int
    vocab_size: int
    tie_word_embeddings: bool
    moe: bool
    weight_parts: tuple[WeightPart, ...]
    layers: LayerKinds  # the kind of every decoder layer (layers.py)
    quantized_mxfp4: bool = False  # MoE experts in MXFP4 (gpt-oss), the rest in the model dtype
    experts_per_token: int = 0  # routed experts per token (num_experts_per_tok); 0 for a dense model
    quantization: str = ""  # the linear layers' quantisation as counted (quant.py), "" for 16-bit

    @property
    def weight_bytes_total(self) -> int:
        return sum(p.nbytes * max(1, len(p.layers)) for p in self.weight_parts if p.special != "rope_cache")


def _get(cfg: dict, key: str, source: str, *, default=None, kind=int):
    value = cfg.get(key, default)
    if value is None:
        if default is None:
            raise ConfigError(f"expected {kind.__name__}, the key is missing", file=source, key=key)
        return default
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"expected a non-negative integer, got {value!r}", file=source, key=key)
    return value


def _dtype_of(cfg: dict, override: str | None, source: str) -> str:
    name = override or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    name = {"auto": cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"}.get(name, name)
    name = str(name).removeprefix("torch.")
    if name not in DTYPE_BYTES or DTYPE_BYTES[name] < 2:
        raise ConfigError(f"expected a model dtype (bfloat16, float16, float32), got {name!r}",
                          file=source, key="dtype")
    return name


def _is_mxfp4_checkpoint(cfg: dict) -> bool:
    q = cfg.get("quantization_config") or {}
    return str(q.get("quant_method", "")).lower() == "mxfp4"


def _indexer_layer_ids(cfg: dict, num_layers: int, source: str) -> tuple[int, ...]:
    if not cfg.get("index_head_dim"):
        return ()
    types = cfg.get("indexer_types")
    if types is None:
        return tuple(range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"expected a list of {num_layers} entries ('full'/'shared')",
                          file=source, key="indexer_types")
    return tuple(i for i, t in enumerate(types) if t == "full")


def geometry_from_config(cfg: dict, name: str = "", *, dtype: str | None = None,
                         source: str = "") -> ModelGeometry:
    """Everything kvprobe needs from a config.json. `dtype` overrides the model dtype (--dtype)."""
    source = source or name or "config.json"
    top = cfg  # a multimodal checkpoint's vision_config sits beside its text_config
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "quantization_config": cfg.get("quantization_config")}
    cfg = {**_CLASS_DEFAULTS.get(str(cfg.get("model_type", "")), {}), **cfg}
    layers_n = _get(cfg, "num_hidden_layers", source)
    hidden = _get(cfg, "hidden_size", source)
    heads = _get(cfg, "num_attention_heads", source)
    if layers_n == 0 or hidden == 0 or heads == 0:
        raise ConfigError("expected num_hidden_layers, hidden_size and num_attention_heads > 0", file=source)
    kv_heads = _get(cfg, "num_key_value_heads", source, default=heads)
    model_type = str(cfg.get("model_type", ""))
    mla = bool(cfg.get("kv_lora_rank"))
    head_dim = cfg.get("head_dim") or hidden // heads
    g = {
        "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "model_type": model_type, "attention": "mla" if mla else "gqa",
        "kv_lora_rank": cfg.get("kv_lora_rank") or 0, "rope": cfg.get("qk_rope_head_dim") or 0,
        "nope": cfg.get("qk_nope_head_dim") or 0, "v_head_dim": cfg.get("v_head_dim") or head_dim,
    }
    if mla and not g["rope"]:
        raise ConfigError("expected qk_rope_head_dim for an MLA model (kv_lora_rank is set)",
                          file=source, key="qk_rope_head_dim")
    dtype_name = _dtype_of(cfg, dtype, source)
    dbytes = DTYPE_BYTES[dtype_name]
    quant = linear_quant(cfg, dbytes, source)
    fp8 = bool(quant and quant.fp8)
    vocab = _get(cfg, "vocab_size", source, default=32000)
    tied = bool(cfg.get("tie_word_embeddings", False))

    kinds = layer_kinds(cfg, layers_n, source=source)
    all_layers = tuple(range(layers_n))
    dense_ids = dense_layer_ids(cfg, layers_n)
    indexer_ids = _indexer_layer_ids(cfg, layers_n, source)
    mxfp4 = _is_mxfp4_checkpoint(cfg)
    if mxfp4 and model_type != "gpt_oss":  # other MXFP4 checkpoints quantise other modules, other kernels
        raise ConfigError(f"kvprobe counts MXFP4 weights for gpt-oss only (its experts); this model_type is "
                          f"{model_type!r}", file=source, key="quantization_config.quant_method")
    p = Parts(dbytes, quant, mxfp4)
    p.plain("embed_tokens", vocab * hidden, "tp", stage="first")
    attention_parts(p, cfg, g, all_layers)
    indexer_parts(p, cfg, g, indexer_ids)
    mlp_parts(p, cfg, g, tuple(sorted(dense_ids)), tuple(i for i in all_layers if i not in dense_ids))
    p.plain("input_layernorm+post_attention_layernorm", 2 * hidden, "replicated", all_layers)
    head_bias = model_type in PHI_LAYOUT
    p.plain("norm", hidden * (2 if head_bias else 1), "replicated", stage="last")
    rope_cache_parts(p, cfg, g)
    vision_parts(p, top, hidden)
    if not tied:
        p.plain("lm_head", vocab * (hidden + (1 if head_bias else 0)), "tp", stage="last")
    params = sum(w.params * max(1, len(w.layers)) for w in p.parts)

    return ModelGeometry(
        name=name or str(cfg.get("_name_or_path", "")) or model_type,
        model_type=model_type,
        num_layers=layers_n,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=1 if mla else kv_heads,
        head_dim=(g["kv_lora_rank"] + g["rope"]) if mla else head_dim,
        v_head_dim=0 if mla else g["v_head_dim"],
        attention=g["attention"],
        kv_lora_rank=g["kv_lora_rank"],
        qk_rope_head_dim=g["rope"],
        indexer_layers=len(indexer_ids),
        indexer_head_dim=cfg.get("index_head_dim") or 0,
        indexer_layer_ids=indexer_ids,
        dtype=dtype_name,
        dtype_bytes=dbytes,
        weight_dtype_bytes=1 if fp8 else dbytes,
        quantized_fp8=fp8,
        param_count=params,
        max_position_embeddings=_get(cfg, "max_position_embeddings", source, default=2048),
        vocab_size=vocab,
        tie_word_embeddings=tied,
        moe=len(dense_ids) < layers_n,
        weight_parts=tuple(p.parts),
        layers=kinds,
        quantized_mxfp4=mxfp4,
        experts_per_token=(int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0)
                           if len(dense_ids) < layers_n else 0),
        quantization=quant.method if quant else ("mxfp4" if mxfp4 else ""),
    )


def pp_stages(num_layers: int, pp: int) -> list[range]:
    """Layer ranges per pipeline stage, ceil split: every stage but the last holds ceil(L/pp)."""
    if pp < 1 or pp > num_layers:
        raise ConfigError(f"expected 1 <= pp <= {num_layers} (layers), got {pp}", key="pp")
    per = math.ceil(num_layers / pp)
    return [range(i * per, min(num_layers, (i + 1) * per)) for i in range(pp)]


@dataclass(frozen=True)
class KVBytes:
    """KV bytes per token on the rank that holds the most (it binds: engines take the minimum pool)."""

    per_layer_main: int
    per_layer_indexer: int
    layers_per_rank: int
    indexer_layers_per_rank: int
    kv_heads_per_rank: int
    main: int
    indexer: int
    total: int
    dtype: str  # the resolved KV cache dtype


def _kv_dtype_bytes(geom: ModelGeometry, kv_cache_dtype: str) -> tuple[str, int]:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"expected one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}",
                          key="kv_cache_dtype")
    if kv_cache_dtype == "fp8_ds_mla":
        if geom.attention != "mla":
            raise ConfigError("fp8_ds_mla is an MLA layout; this model uses standard attention",
                              key="kv_cache_dtype")
        return kv_cache_dtype, 1
    if kv_cache_dtype == "auto":
        return geom.dtype, geom.dtype_bytes
    return kv_cache_dtype, DTYPE_BYTES[kv_cache_dtype]


def kv_bytes_per_token(geom: ModelGeometry, *, kv_cache_dtype: str = "auto", tp: int = 1,
                       pp: int = 1) -> KVBytes:
    """Bytes one token writes across the layers that keep K/V per token (full, sliding and chunked
    attention alike); linear-attention layers keep a per-request state instead (vllm/hybrid/kv_cache_spec.py,
    sglang/pools.py size it). For a hybrid model this is not the pool's bytes per token: what a
    window or chunk layer holds is bounded per request, and each engine bounds it its own way."""
    if tp < 1:
        raise ConfigError(f"expected tp >= 1, got {tp}", key="tp")
    dtype, nbytes = _kv_dtype_bytes(geom, kv_cache_dtype)
    if geom.attention == "mla":
        kv_heads = 1  # the latent is not split by TP
        if dtype == "fp8_ds_mla":
            r = geom.kv_lora_rank
            per_layer = r + r // _SCALE_BLOCK * 4 + geom.qk_rope_head_dim * 2
        else:
            per_layer = (geom.kv_lora_rank + geom.qk_rope_head_dim) * nbytes
    else:
        kv_heads = max(1, geom.num_kv_heads // tp)
        per_layer = kv_heads * (geom.head_dim + geom.v_head_dim) * nbytes
    d = geom.indexer_head_dim
    per_indexer = d + d // _SCALE_BLOCK * 4 if d else 0
    indexer_ids = set(geom.indexer_layer_ids)
    kv_layers = {i for i, k in enumerate(geom.layers.kinds) if k in ATTENTION_KINDS}
    best = None
    for stage in pp_stages(geom.num_layers, pp):
        n_idx = sum(1 for i in stage if i in indexer_ids)
        n_kv = sum(1 for i in stage if i in kv_layers)
        total = n_kv * per_layer + n_idx * per_indexer
        if best is None or total > best[0]:
            best = (total, n_kv, n_idx)
    total, n_layers, n_idx = best
    return KVBytes(per_layer, per_indexer, n_layers, n_idx, kv_heads, n_layers * per_layer,
                   n_idx * per_indexer, total, dtype)


def experts_on_rank(experts: int, ep: int) -> int:
    """Routed experts on the most loaded rank under expert parallelism over `ep` ranks: whole experts,
    the first `experts % ep` ranks one more (vLLM 0.29.0 `fused_moe/expert_map_manager.py`
    determine_expert_map L67-69, the default linear placement; the L4 log: `Local/global number of
    experts: 16/32`)."""
    return -(-experts // ep)


def _expert_part_on_rank(part: WeightPart, ep: int, engine: str | None, gpu_arch: str) -> int:
    """A routed-expert part under EP: the MoE layer's own TP is 1, each rank holds whole experts
    (vLLM 0.29.0 `fused_moe/config.py` FusedMoEParallelConfig.make L1212-1256: ep_size = tp x dp,
    tp_size 1), so the intermediate size is not split and MXFP4 pads the whole of it."""
    experts = part.dims[0]
    local = experts_on_rank(experts, ep)
    if engine is not None and part.special.startswith("mxfp4_"):
        _, hidden, inter = part.dims
        return engine_expert_bytes(part.special.removeprefix("mxfp4_"), local, hidden, inter,
                                   engine=engine, gpu_arch=gpu_arch, tp=1)
    return math.ceil(part.nbytes * local / experts)


def _part_bytes_on_rank(part: WeightPart, nbytes: int, geom: ModelGeometry, tp: int,
                        engine: str | None, gpu_arch: str, ep: int = 1) -> int:
    if ep > 1 and (part.special == "experts" or part.special.startswith("mxfp4_")):
        return _expert_part_on_rank(part, ep, engine, gpu_arch)
    if engine is not None and part.special.startswith("mxfp4_"):
        experts, hidden, inter = part.dims
        return engine_expert_bytes(part.special.removeprefix("mxfp4_"), experts, hidden, inter,
                                   engine=engine, gpu_arch=gpu_arch, tp=tp)
    if part.special == "rope_cache":  # an engine buffer, not the checkpoint's: rope_cache_bytes()
        return 0
    if part.special == "sinks":
        return part.params // tp * sink_bytes(engine, gpu_arch, geom.dtype_bytes)
    if part.shard == "tp":
        return math.ceil(nbytes / tp)
    if part.shard == "kv":
        return math.ceil(nbytes * max(1, geom.num_kv_heads // tp) / geom.num_kv_heads)
    return nbytes


def rope_cache_bytes(geom: ModelGeometry) -> int:
    """vLLM's rotary cos/sin cache(s) on every rank (weights.rope_cache_parts): in the weights memory the
    engine logs, not in the checkpoint; the releases read in vllm/memory_profile.py add it to the weights."""
    return sum(p.nbytes for p in geom.weight_parts if p.special == "rope_cache")


def weight_bytes(geom: ModelGeometry, *, tp: int = 1, pp: int = 1, engine: str | None = None,
                 gpu_arch: str = DEFAULT_GPU_ARCH, ep: int = 1) -> int:
    """Weight bytes on the most loaded rank (embeddings on the first PP stage, lm_head on the last).
    Without `engine`, the checkpoint's bytes split by TP; with it ("vllm"/"sglang"), the parts whose
    GPU layout is an engine fact (MXFP4 experts, sinks: mxfp4.py) as that engine allocates them on
    `gpu_arch`. `ep` > 1: the routed experts are placed whole over `ep` ranks (expert parallelism)
    instead of split by TP."""
    if tp < 1:
        raise ConfigError(f"expected tp >= 1, got {tp}", key="tp")
    stages = pp_stages(geom.num_layers, pp)
    loads = []
    for s, stage in enumerate(stages):
        total = 0
        for part in geom.weight_parts:
            if part.layers:
                n = sum(1 for i in part.layers if i in stage)
            elif part.stage == "first":
                n = 1 if s == 0 else 0
            elif part.stage == "last":
                n = 1 if s == len(stages) - 1 else 0
            else:
                n = 1
            total += n * _part_bytes_on_rank(part, part.nbytes, geom, tp, engine, gpu_arch, ep)
        loads.append(total)
    return max(loads)
