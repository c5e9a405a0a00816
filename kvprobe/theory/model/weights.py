"""The parameter groups of a decoder model (`WeightPart`s) from its config.json: attention, DSA
indexer, dense and MoE MLPs, as the engines shard them (geometry.py sums them per rank).

Quantised checkpoints (fp8, GPTQ, AWQ, compressed-tensors) count their linear weights as `quant.py`
lays them out; MXFP4 checkpoints (gpt-oss) count their experts as `mxfp4.py` lays them out.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvprobe.theory.model.mxfp4 import expert_tensor_bytes
from kvprobe.theory.model.quant import LinearQuant


@dataclass(frozen=True)
class WeightPart:
    """One group of parameters: how many, their bytes, and how TP/PP distribute them."""

    name: str
    params: int  # per layer for layer parts
    nbytes: int  # per layer for layer parts, including fp8 block scales
    shard: str  # "tp" (split by TP), "replicated", "kv" (KV heads: max(1, kv//tp) of kv)
    layers: tuple[int, ...] = ()  # layer indices holding it; empty = a model-level part
    stage: str = "layer"  # "first" (embeddings), "last" (final norm, lm_head) or "layer"
    # Parts whose bytes on a rank are an engine fact (weight_bytes(engine=)): "mxfp4_w13"/"mxfp4_w2"
    # (MXFP4 experts, dims = (experts, hidden, intermediate)), "sinks" (gpt-oss attention sinks);
    # "experts" (the routed experts of a MoE layer, dims = (experts,)): split by TP, or whole experts per
    # rank under expert parallelism (weight_bytes(ep=)).
    special: str = ""
    dims: tuple[int, ...] = ()


def dense_layer_ids(cfg: dict, num_layers: int) -> set[int]:
    """Layers with a dense MLP; the rest are MoE (DeepSeek/GLM: first_k_dense_replace, moe_layer_freq)."""
    if not (cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")):
        return set(range(num_layers))
    types = cfg.get("mlp_layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        return {i for i, t in enumerate(types) if t == "dense"}
    step = cfg.get("interleave_moe_layer_step")  # Llama-4: every step-th layer is MoE (vLLM llama4.py L340-344)
    if step:
        return {i for i in range(num_layers) if (i + 1) % step != 0}
    first_k = cfg.get("first_k_dense_replace") or 0
    freq = cfg.get("moe_layer_freq") or 1
    return {i for i in range(num_layers) if i < first_k or (i - first_k) % freq != 0}


class Parts:
    """Collects WeightParts; linear weights of decoder layers take the checkpoint's quantised layout."""

    def __init__(self, dtype_bytes: int, quant: LinearQuant | None, mxfp4: bool = False):
        self.dtype_bytes, self.quant, self.mxfp4 = dtype_bytes, quant, mxfp4
        self.parts: list[WeightPart] = []

    def linear(self, name, out_f, in_f, shard, layers, *, bias=False, quantizable=True, special="", dims=()):
        params = out_f * in_f
        if self.quant and quantizable:
            nbytes = self.quant.nbytes(out_f, in_f)  # packed weight, scales, zero points (quant.py)
        else:
            nbytes = params * self.dtype_bytes
        if bias:
            params += out_f
            nbytes += out_f * self.dtype_bytes
        self.parts.append(WeightPart(name, params, nbytes, shard, tuple(layers), "layer", special, dims))

    def plain(self, name, params, shard, layers=(), stage="layer", nbytes=None, special=""):
        nb = params * self.dtype_bytes if nbytes is None else nbytes
        self.parts.append(WeightPart(name, params, nb, shard, tuple(layers), stage, special))

    def mxfp4_experts(self, kind, name, experts, hidden, inter, layers, *, bias):
        """MXFP4 experts at the checkpoint's bytes (mxfp4.py); engines pad them (weight_bytes)."""
        rows, cols = (2 * inter, hidden) if kind == "w13" else (hidden, inter)
        params = experts * rows * (cols + (1 if bias else 0))
        nbytes = expert_tensor_bytes(kind, experts, hidden, inter, bias=bias)
        self.parts.append(WeightPart(name, params, nbytes, "tp", tuple(layers), "layer", f"mxfp4_{kind}",
                                     (experts, hidden, inter)))


def attention_parts(p: Parts, cfg: dict, g: dict, layers: tuple[int, ...]) -> None:
    h, heads = g["hidden"], g["heads"]
    if g["attention"] == "mla":
        r, rope, nope, v = g["kv_lora_rank"], g["rope"], g["nope"], g["v_head_dim"]
        q_lora = cfg.get("q_lora_rank")
        if q_lora:  # DeepSeek-V3 q path: q_a (replicated) -> norm -> q_b (column parallel)
            p.linear("q_a_proj", q_lora, h, "replicated", layers)
            p.plain("q_a_layernorm", q_lora, "replicated", layers)
            p.linear("q_b_proj", heads * (nope + rope), q_lora, "tp", layers)
        else:
            p.linear("q_proj", heads * (nope + rope), h, "tp", layers)
        p.linear("kv_a_proj_with_mqa", r + rope, h, "replicated", layers)
        p.plain("kv_a_layernorm", r, "replicated", layers)
        p.linear("kv_b_proj", heads * (nope + v), r, "tp", layers)
        p.linear("o_proj", h, heads * v, "tp", layers)
        return
    kv, hd = g["kv_heads"], g["head_dim"]
    phi = g["model_type"] in PHI_LAYOUT
    qkv_bias = bool(cfg.get("attention_bias")) or g["model_type"] in ("qwen2", "qwen2_moe") or phi
    p.linear("q_proj", heads * hd, h, "tp", layers, bias=qkv_bias)
    p.linear("k_proj", kv * hd, h, "kv", layers, bias=qkv_bias)
    p.linear("v_proj", kv * hd, h, "kv", layers, bias=qkv_bias)
    p.linear("o_proj", h, heads * hd, "tp", layers, bias=bool(cfg.get("attention_bias")) or phi)
    if g["model_type"] in ("qwen3", "qwen3_moe"):  # per-head RMSNorm on q and k
        p.plain("q_norm+k_norm", 2 * hd, "replicated", layers)
    if g["model_type"] == "gpt_oss":  # one learned sink logit per head (vLLM gpt_oss.py L131)
        p.plain("self_attn.sinks", heads, "tp", layers, special="sinks")


def indexer_parts(p: Parts, cfg: dict, g: dict, layers: tuple[int, ...]) -> None:
    """DSA lightning indexer (DeepSeek-V3.2 / GLM-5 style): wq_b, wk, k_norm, weights_proj."""
    if not layers:
        return
    d, n = cfg["index_head_dim"], cfg.get("index_n_heads") or 64
    q_in = cfg.get("q_lora_rank") or g["hidden"]
    p.linear("indexer.wq_b", n * d, q_in, "replicated", layers)
    p.linear("indexer.wk", d, g["hidden"], "replicated", layers)
    p.plain("indexer.k_norm", 2 * d, "replicated", layers)
    p.linear("indexer.weights_proj", n, g["hidden"], "replicated", layers, quantizable=False)


# Model types laid out as vLLM's phi.py builds phi (0.18.1): an MLP of one up projection and one down, no gate
# (PhiMLP fc1 ColumnParallelLinear and fc2 RowParallelLinear, both of default bias=True, n_inner wide or 4 x
# hidden: L147-165), qkv_proj with a bias and dense of default bias=True (L95-108), a LayerNorm (weight and
# bias) for the final norm and an lm_head with a bias (L225, L326-330). So counted, phi-2 has 2,779,683,840
# parameters, its checkpoint's index total (5,559,367,680 bytes in fp16); a gated count put it 30% high.
PHI_LAYOUT = ("phi",)


def mlp_parts(p: Parts, cfg: dict, g: dict, dense: tuple[int, ...], moe: tuple[int, ...]) -> None:
    h = g["hidden"]
    if g["model_type"] in PHI_LAYOUT:
        width = cfg.get("n_inner") or 4 * h
        p.linear("mlp.fc1", width, h, "tp", dense, bias=True)
        p.linear("mlp.fc2", h, width, "tp", dense, bias=True)
        return
    inter = cfg.get("intermediate_size") or 4 * h
    bias = bool(cfg.get("mlp_bias"))
    if dense:  # Llama-4's dense layers are intermediate_size_mlp wide (vLLM llama4.py L352)
        dense_inter = cfg.get("intermediate_size_mlp") or inter
        p.linear("mlp.gate_up_proj", 2 * dense_inter, h, "tp", dense, bias=bias)
        p.linear("mlp.down_proj", h, dense_inter, "tp", dense, bias=bias)
    if not moe:
        return
    n_routed = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    mi = cfg.get("moe_intermediate_size") or inter
    # gpt-oss: experts and router carry biases (vLLM 0.33.0 models/gpt_oss.py L385, L399)
    gpt_oss = g["model_type"] == "gpt_oss"
    if p.mxfp4:
        p.mxfp4_experts("w13", "experts.gate_up_proj", n_routed, h, mi, moe, bias=gpt_oss)
        p.mxfp4_experts("w2", "experts.down_proj", n_routed, h, mi, moe, bias=gpt_oss)
    else:
        p.linear("experts.gate_up_proj", n_routed * 2 * mi, h, "tp", moe, special="experts", dims=(n_routed,))
        p.linear("experts.down_proj", n_routed * h, mi, "tp", moe, special="experts", dims=(n_routed,))
    # The shared experts beside the routed ones: Llama-4's and DeepSeek's n_shared_experts of the routed width
    # (vLLM llama4.py Llama4MoE L100-113); Qwen2-MoE's and Qwen3-Next's one of shared_expert_intermediate_size,
    # with a one-output gate on it kept unquantised (vLLM 0.18.1 qwen2_moe.py L143-160, qwen3_next.py
    # L299-318): Qwen1.5-MoE-A2.7B counts keras-hub's 14,315,784,192 parameters with them, 0.83 B fewer without
    shared = cfg.get("n_shared_experts") or (1 if g["model_type"] == "llama4_text" else 0)
    gated = cfg.get("shared_expert_intermediate_size") or 0
    wide = gated or shared * mi
    if wide:
        p.linear("shared_experts.gate_up_proj", 2 * wide, h, "tp", moe)
        p.linear("shared_experts.down_proj", h, wide, "tp", moe)
    if gated:
        p.linear("shared_expert_gate", 1, h, "replicated", moe, quantizable=False)
    # The router stays in the model dtype in fp8 checkpoints; noaux_tc adds an fp32 bias per expert.
    p.linear("router.gate", n_routed, h, "replicated", moe, bias=gpt_oss, quantizable=False)
    if cfg.get("topk_method") == "noaux_tc":
        p.plain("router.e_score_correction_bias", n_routed, "replicated", moe, nbytes=n_routed * 4)


def rope_cache_parts(p: Parts, cfg: dict, g: dict) -> None:
    """vLLM's rotary cos/sin cache: a `max_position_embeddings x rotary_dim` buffer in the model dtype, built
    on the GPU with the model (layers/rotary_embedding/base.py L58-63, 0.33.0; get_rope shares one per
    distinct rope, __init__.py L74-85), so it is in the weights memory the engine logs. Negligible for most
    models (Llama-3.1: 32 MiB); 2.5 GiB for Llama-4-Scout's 10M positions. Gemma-3 builds two (local and
    global rope). Not checkpoint bytes: weight_bytes() leaves it out, geometry.rope_cache_bytes() gives it."""
    if g["attention"] == "mla":
        rotary = g["rope"]
    else:
        rotary = int(g["head_dim"] * (cfg.get("partial_rotary_factor") or 1.0))
    positions = cfg.get("max_position_embeddings") or 2048
    caches = 2 if g["model_type"] in ("gemma3_text", "gemma3") else 1
    p.plain("rotary.cos_sin_cache", 0, "replicated", nbytes=caches * positions * rotary * p.dtype_bytes,
            special="rope_cache")
