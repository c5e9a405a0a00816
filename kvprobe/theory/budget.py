"""Memory budget -> KV pool, for vLLM (measure, then split) and SGLang (formula, then measure).

Seed 001 states the one equation both engines follow, with total memory T, weights W, activation
peak A, CUDA graphs G and other residents O (CUDA context, NCCL buffers):

    vLLM:   K = ceil(T * gpu_memory_utilization) - W - O - A - G     (A measured, G estimated)
    SGLang: K = T * mem_fraction_static - W                          (f = (T - R) / T by formula)

vLLM measures A, G and O on the GPU at startup; kvprobe can only estimate them, so every estimate
is a named function below, reported in `VllmBudget.estimates` and replaceable through
`estimates={"activation_bytes": ..., "cudagraph_bytes": ..., "other_bytes": ...}`. The upper
bound (`kv_pool_bytes_upper`, seed 001's 7.12 GiB) subtracts weights only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import KVBytes, ModelGeometry
from kvprobe.theory.sglang.pools import SglangLayout, SglangOptions, SglangPools, sglang_layout, sglang_pools
from kvprobe.theory.vllm.hybrid.kv_cache_spec import (
    MAMBA_SPEC,
    VllmKVPlan,
    VllmOptions,
    plan_layout,
    vllm_kv_plan,
)
from kvprobe.units import format_bytes

GIB = 2**30
MIB = 2**20

# ---------------------------------------------------------------------------------------- vLLM

# `config/cache.py` gpu_memory_utilization default: 0.92 in 0.33.0 (L215), 0.9 in 0.11.0 and 0.9.2.
VLLM_GPU_MEMORY_UTILIZATION = {"0.33": 0.92, "0.11": 0.9, "0.9": 0.9}
VLLM_DEFAULT_VERSION = "0.33.0"
VLLM_DEFAULT_BLOCK_SIZE = 16  # CacheConfig.DEFAULT_BLOCK_SIZE (config/cache.py L185)
# MLA on Hopper selects FLASHMLA, whose kernels take only 64-token blocks (reference §1.5); the
# DSA indexer kernels are likewise fixed at 64 (seed 002). We assume that backend for MLA models.
VLLM_MLA_BLOCK_SIZE = 64


def _version_key(version: str | None, known: dict) -> str:
    v = (version or VLLM_DEFAULT_VERSION).lstrip("v")
    parts = v.split(".")
    for n in (2, 1):
        key = ".".join(parts[:n])
        if key in known:
            return key
    # Unknown versions: the newest rule we know for newer ones, the oldest for older ones.
    newest = max(known, key=lambda k: tuple(int(x) for x in k.split(".")))
    oldest = min(known, key=lambda k: tuple(int(x) for x in k.split(".")))
    try:
        mine = tuple(int(x) for x in parts[:2])
    except ValueError as err:
        raise ConfigError(f"expected an engine version like 0.33.0, got {version!r}",
                          key="engine_version") from err
    return newest if mine >= tuple(int(x) for x in newest.split(".")) else oldest


def sglang_hybrid_layout(geom: ModelGeometry, model_config: dict | None, opts: SglangOptions | None,
                         pp: int = 1) -> SglangLayout | None:
    """How SGLang pools a hybrid model (sglang_pools.sglang_layout), or None for one uniform pool.
    Gemma 2/3, Mistral and --disable-hybrid-swa-memory pool every layer as full: the uniform budget
    is then SGLang's own. A window model gets a full and a window pool; Qwen3-Next a full pool over
    its full-attention layers and a recurrent-state (Mamba) pool. Refused naming the key: a hybrid
    pool across pipeline stages."""
    if not geom.layers.hybrid:
        return None
    if model_config is None or opts is None:
        raise ConfigError(f"{geom.name} has {geom.layers.describe()} layers: SGLang's budget needs the model's "
                          "config.json and the hybrid options (sglang_budget(model_config=, hybrid_opts=))",
                          key=geom.layers.key or "layer_types")
    lay = sglang_layout(model_config, geom, opts)
    if lay.pool == "full":
        return None
    if pp > 1:
        raise ConfigError("SGLang's hybrid sliding-window pools are sized for one pipeline stage only", key="pp")
    return lay


def vllm_default_gpu_memory_utilization(version: str | None = None) -> float:
    return VLLM_GPU_MEMORY_UTILIZATION[_version_key(version, VLLM_GPU_MEMORY_UTILIZATION)]


def vllm_default_block_size(geom: ModelGeometry) -> int:
    return VLLM_MLA_BLOCK_SIZE if geom.attention == "mla" else VLLM_DEFAULT_BLOCK_SIZE


def vllm_batch_defaults(gpu_memory_bytes: int | None, max_model_len: int, *,
                        gpu_name: str | None = None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of `vllm serve` 0.33.0 (arg_utils.get_batch_defaults).

    Tiers by device memory: >= 160 GiB -> 1024 / 16384; >= 70 GiB and not an A100 (H100/H200
    class) -> 1024 / 8192; everything else -> 256 / 2048. Without a GPU name a >= 70 GiB card is
    taken as H100/H200 class. Then the token budget is capped at max_num_seqs * max_model_len and
    max_num_seqs at the token budget (chunked prefill on).
    """
    mem = gpu_memory_bytes or 0
    a100 = bool(gpu_name) and "a100" in gpu_name.lower()
    if mem >= 160 * GIB:
        seqs, tokens = 1024, 16384
    elif mem >= 70 * GIB and not a100:
        seqs, tokens = 1024, 8192
    else:
        seqs, tokens = 256, 2048
    tokens = min(tokens, seqs * max_model_len)
    return min(seqs, tokens), tokens


def estimate_vllm_other_bytes(*, tp: int = 1, pp: int = 1) -> int:
    """CUDA context + cuBLAS workspaces + allocator slack vLLM counts in `total_consumed`.

    A typical H100 process holds ~0.5 GiB before any tensor; NCCL buffers add ~0.25 GiB when
    the rank talks to others. Rough by nature: override with estimates["other_bytes"].
    """
    return 512 * MIB + (256 * MIB if tp * pp > 1 else 0)


def estimate_vllm_activation_bytes(geom: ModelGeometry, *, max_num_batched_tokens: int,
                                   max_num_seqs: int, tp: int = 1) -> int:
    """Peak of the profile run (a forward of max_num_batched_tokens tokens + a sampler run).

    Forward: the widest live intermediates of one layer (gate_up output, its activation and the
    residual stream, in the model dtype). Sampler: fp32 logits of max_num_seqs rows, with one copy
    for the softmax. Override with estimates["activation_bytes"].
    """
    parts = {p.name: p for p in geom.weight_parts}
    widest = geom.hidden_size * 4
    for name in ("mlp.gate_up_proj", "shared_experts.gate_up_proj"):
        if name in parts:
            widest = max(widest, parts[name].params // geom.hidden_size // tp)
    if "experts.gate_up_proj" in parts:  # routed experts: each token goes to top_k of them
        gate_up = parts["experts.gate_up_proj"]  # MXFP4 parts count their biases: use the width itself
        per_expert = gate_up.dims[0] * 2 * gate_up.dims[2] if gate_up.dims else gate_up.params // geom.hidden_size
        widest = max(widest, per_expert // max(1, _n_experts(geom)) * 8 // tp)
    forward = max_num_batched_tokens * (widest * 3 // 2 + 4 * geom.hidden_size) * geom.dtype_bytes
    sampler = max_num_seqs * geom.vocab_size * 4 * 2
    return forward + sampler


def _n_experts(geom: ModelGeometry) -> int:
    parts = {p.name: p for p in geom.weight_parts}
    gate = parts.get("router.gate")
    return gate.params // geom.hidden_size if gate else 1


def estimate_vllm_cudagraph_bytes(geom: ModelGeometry, *, max_num_seqs: int) -> int:
    """vLLM's own `profile_cudagraph_memory()` estimate, approximated.

    Decode graphs are captured for batch sizes up to min(512, max_num_seqs); the pool holds the
    largest graph's intermediates plus per-graph bookkeeping. Observed pools are ~0.3-1 GiB for
    dense 7-70B models. We use 256 MiB + the largest batch's residual-stream buffers.
    Override with estimates["cudagraph_bytes"].
    """
    largest = min(512, max_num_seqs)
    return 256 * MIB + largest * geom.hidden_size * geom.dtype_bytes * 16


def vllm_capacity_numbers(num_blocks: int, block_size: int, max_model_len: int) -> tuple[int, float]:
    """(num_tokens, max_concurrency) of `GPU KV cache size: N tokens, Maximum concurrency ...`.

    vLLM 0.33.0 `kv_cache_utils.py::get_max_concurrency_for_kv_cache_config` /
    `get_kv_cache_capacity` for one full-attention group: concurrency = num_blocks (null block
    included) / cdiv(max_model_len, block_size); tokens = int(concurrency * max_model_len).
    """
    per_request = -(-max_model_len // block_size)
    concurrency = num_blocks / per_request
    return int(concurrency * max_model_len), concurrency


def _gib(nbytes: float) -> str:
    return str(round(nbytes / GIB, 2))  # vLLM's format_gib (utils/mem_utils.py L30)


def vllm_check_fits(num_blocks: int, bytes_per_block: int, block_size: int, max_model_len: int,
                    available_bytes: int) -> None:
    """`_check_enough_kv_cache_memory` (kv_cache_planning.py L50-87): refuse at startup when one
    request of max_model_len does not fit the usable blocks (the null block excluded)."""
    if available_bytes <= 0 or num_blocks <= 0:
        raise ConfigError("No available memory for the cache blocks. Try increasing "
                          "`gpu_memory_utilization` when initializing the engine.")
    needed_blocks = -(-max_model_len // block_size)
    if num_blocks - 1 >= needed_blocks:
        return
    estimated = max(0, (num_blocks - 1) * block_size)
    raise ConfigError(
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({_gib(needed_blocks * bytes_per_block)} GiB KV cache is needed, which is larger than the "
        f"available KV cache memory ({_gib(available_bytes)} GiB). Based on the available memory, "
        f"the estimated maximum model length is {estimated}. Try increasing `gpu_memory_utilization` "
        f"(which also controls CPU memory on the CPU backend) or decreasing `max_model_len` when "
        f"initializing the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ "
        f"for more details."
    )


@dataclass
class VllmBudget:
    total_bytes: int | None
    fraction: float | None  # gpu_memory_utilization
    requested_bytes: int | None
    weights: int
    other: int
    activation: int
    cudagraph: int
    kv_pool_bytes: int | None  # what the worker would log as "Available KV cache memory"
    kv_pool_bytes_upper: int | None  # requested - weights: seed 001's upper bound
    bytes_per_block: int
    num_blocks: int  # as vLLM logs it: includes the null block
    num_blocks_upper: int | None
    block_size: int
    kv_tokens: int  # "GPU KV cache size: N tokens"
    kv_tokens_upper: int | None  # floor(upper / bytes per token)
    max_model_len: int
    max_concurrency_at_max_model_len: float
    fits_max_model_len: bool
    source: str  # "profiled" | "kv_cache_memory_bytes" | "num_gpu_blocks_override"
    estimates: dict[str, int] = field(default_factory=dict)  # the non-KV terms that were estimated
    # vLLM's start-up refusal text when it would not start with this pool (vllm_budget(refuse=False)),
    # and the largest max_model_len the pool holds: (num_blocks - 1) x block_size, as vLLM's message says.
    refusal: str | None = None
    largest_max_model_len: int = 0
    plan: VllmKVPlan | None = None  # a hybrid model's groups (vllm_kv.vllm_kv_plan); None: one uniform pool

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1


def vllm_budget(geom: ModelGeometry, kv: KVBytes, *, weights: int, gpu_memory_bytes: int | None,
                max_model_len: int, gpu_memory_utilization: float | None = None,
                version: str | None = None, block_size: int | None = None,
                max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, tp: int = 1, pp: int = 1,
                kv_cache_memory_bytes: int | None = None, num_gpu_blocks_override: int | None = None,
                estimates: dict[str, int] | None = None, auto_fit: bool = False,
                refuse: bool = True, plan_opts: VllmOptions | None = None) -> VllmBudget:
    """Pool of one worker. `auto_fit` = `--max-model-len auto`: shrink max_model_len to fit.

    Where vLLM would refuse to start (one max_model_len request does not fit the pool), this raises
    its message as a ConfigError; with `refuse=False` the budget is returned with `refusal` set, so
    a ledger can still show every number that leads to the refusal.

    A hybrid model (window, chunked-local or linear layers) is planned by `vllm_kv.vllm_kv_plan`
    with `plan_opts` (the engine settings its layout depends on): its groups share one pool whose
    block is the largest group's page, and the capacity line divides by the sum over groups
    (`VllmBudget.plan`)."""
    if geom.layers.hybrid and plan_opts is None:
        raise ConfigError(f"{geom.name} has {geom.layers.describe()} layers: its vLLM pool needs the "
                          "hybrid plan's options (vllm_budget(plan_opts=...))", key=geom.layers.key or "layer_types")
    estimates = dict(estimates or {})
    unknown = set(estimates) - {"activation_bytes", "cudagraph_bytes", "other_bytes"}
    if unknown:
        raise ConfigError(f"unknown estimate(s) {sorted(unknown)}; expected activation_bytes, "
                          "cudagraph_bytes, other_bytes", key="estimates")
    block = block_size or vllm_default_block_size(geom)
    bytes_per_block = kv.total * block  # layers_on_rank x page bytes (MLA: one latent, no factor 2)
    if geom.layers.hybrid:
        _, layout, bytes_per_block, _, _ = plan_layout(geom, plan_opts, max_model_len)
        block = layout[0].block_size if layout[0].spec != MAMBA_SPEC else \
            next((g.block_size for g in layout if g.spec != MAMBA_SPEC), layout[0].block_size)
    fraction = gpu_memory_utilization if gpu_memory_utilization is not None else \
        vllm_default_gpu_memory_utilization(version)
    if not 0 < fraction <= 1:
        raise ConfigError(f"expected 0 < gpu_memory_utilization <= 1, got {fraction}",
                          key="gpu_memory_utilization")
    used: dict[str, int] = {}
    other = estimates.get("other_bytes")
    if other is None:
        other = used["other_bytes"] = estimate_vllm_other_bytes(tp=tp, pp=pp)
    act = estimates.get("activation_bytes")
    if act is None:
        act = used["activation_bytes"] = estimate_vllm_activation_bytes(
            geom, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, tp=tp)
    graph = estimates.get("cudagraph_bytes")
    if graph is None:
        graph = used["cudagraph_bytes"] = estimate_vllm_cudagraph_bytes(geom, max_num_seqs=max_num_seqs)

    requested = upper = upper_blocks = upper_tokens = None
    # --kv-cache-memory-bytes replaces the memory split: no fraction is requested, nothing profiled.
    if gpu_memory_bytes is not None and kv_cache_memory_bytes is None:
        requested = math.ceil(gpu_memory_bytes * fraction)  # v1/worker/utils.py::request_memory
        upper = requested - weights
        upper_blocks = max(0, upper // bytes_per_block)
        upper_tokens = max(0, upper // kv.total)
        if geom.layers.hybrid:  # the capacity line of the upper pool: blocks / blocks per request x length
            upper_tokens = int(upper_blocks / sum(g.blocks_per_request for g in layout) * max_model_len)
    if kv_cache_memory_bytes is not None:
        kv_pool, source = kv_cache_memory_bytes, "kv_cache_memory_bytes"
    elif requested is not None:
        kv_pool, source = requested - weights - other - act - graph, "profiled"
    else:
        kv_pool, source = None, "num_gpu_blocks_override"
    if num_gpu_blocks_override is not None:
        num_blocks, source = num_gpu_blocks_override, "num_gpu_blocks_override"
        available = num_blocks * bytes_per_block  # vLLM re-plans with N x bytes_per_block
    elif kv_pool is None:
        raise ConfigError("the GPU memory is needed to size the KV pool (give --gpu-memory, "
                          "--kv-cache-memory-bytes or --num-gpu-blocks-override)", key="gpu_memory")
    else:
        num_blocks, available = max(0, kv_pool // bytes_per_block), kv_pool
    if geom.layers.hybrid:
        return _hybrid_budget(geom, plan_opts, max_model_len, auto_fit, refuse, num_gpu_blocks_override,
                              kv_pool, VllmBudget(gpu_memory_bytes, fraction if kv_cache_memory_bytes is None
                                                  else None, requested, weights, other, act, graph, kv_pool,
                                                  upper, bytes_per_block, num_blocks, upper_blocks, block, 0,
                                                  upper_tokens, max_model_len, 0.0, True, source, used))
    refusal = None
    try:
        if auto_fit:
            if num_blocks <= 1:
                raise ConfigError("Cannot auto-fit max_model_len: not enough GPU memory available to serve "
                                  "even a single token.")
            max_model_len = min(max_model_len, (num_blocks - 1) * block)
        vllm_check_fits(num_blocks, bytes_per_block, block, max_model_len, available - bytes_per_block)
    except ConfigError as err:
        if refuse:
            raise
        refusal = str(err)
    fits = num_blocks - 1 >= -(-max_model_len // block)
    tokens, concurrency = vllm_capacity_numbers(max(num_blocks, 0), block, max_model_len)
    return VllmBudget(gpu_memory_bytes, fraction if kv_cache_memory_bytes is None else None, requested,
                      weights, other, act, graph, kv_pool, upper, bytes_per_block, num_blocks,
                      upper_blocks, block, tokens, upper_tokens, max_model_len, concurrency, fits,
                      source, used, refusal, max(0, (num_blocks - 1) * block))


def _hybrid_budget(geom: ModelGeometry, opts: VllmOptions, max_model_len: int, auto_fit: bool, refuse: bool,
                   override: int | None, kv_pool: int | None, split: VllmBudget) -> VllmBudget:
    """The memory split's pool planned as vLLM plans a hybrid model (vllm_kv.vllm_kv_plan)."""
    plan = vllm_kv_plan(geom, max_model_len=max_model_len, available_bytes=None if override is not None
                        else kv_pool, num_gpu_blocks_override=override, opts=opts, auto_fit=auto_fit,
                        refuse=refuse)
    return dataclasses.replace(
        split, num_blocks=plan.num_blocks, block_size=plan.block_size, kv_tokens=plan.kv_tokens,
        max_model_len=plan.max_model_len, max_concurrency_at_max_model_len=plan.max_concurrency,
        fits_max_model_len=plan.refusal is None, refusal=plan.refusal,
        largest_max_model_len=plan.largest_max_model_len, plan=plan)


# -------------------------------------------------------------------------------------- SGLang

SGLANG_DEFAULT_VERSION = "0.5.23"


def sglang_gpu_tier(gpu_mem_mib: int | None, *, tp: int = 1) -> tuple[int, int]:
    """(chunked_prefill_size, decode cuda-graph max_bs) by `memory.total` in MiB.

    SGLang 0.5.23 `arg_groups/memory_hook.py::handle_gpu_memory_settings` L89-180.
    """
    if gpu_mem_mib is None:
        return 4096, 160
    if gpu_mem_mib < 20 * 1024:
        return 2048, 8
    if gpu_mem_mib < 35 * 1024:
        return 4096, 48 if tp < 4 else 160
    if gpu_mem_mib < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if gpu_mem_mib < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


# Prefill cuda-graph capture sizes (0.5.23 `arg_groups/cuda_graph_hook.py`
# `generate_prefill_cuda_graph_batch_sizes`): token counts on a grid that coarsens as it grows,
# every size up to max_bs. Segments are (first, last, step); the open last segment runs to max_bs.
_PREFILL_GRID = ((4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256))
_PREFILL_TAIL = (4608, 512)


def sglang_prefill_graph_sizes(max_bs: int) -> list[int]:
    sizes = [s for first, last, step in _PREFILL_GRID for s in range(first, last + 1, step)]
    start, step = _PREFILL_TAIL
    sizes += list(range(start, max_bs + 1, step))
    return [s for s in sizes if s <= max_bs]


def sglang_reserved_mib(gpu_mem_mib: int | None, *, chunked_prefill_size: int, tp: int = 1, pp: int = 1,
                        mla: bool = False, cuda_graph_max_bs: int, prefill_graphs: bool = True,
                        decode_graphs: bool = True, max_prefill_tokens: int = 16384,
                        prefill_graph_max_bs: int | None = None) -> float:
    """MiB SGLang keeps outside mem_fraction_static (memory_hook.py L281-328, L357-399)."""
    if chunked_prefill_size > 0:
        activation_tokens = max(chunked_prefill_size, 2048)
    else:
        activation_tokens = max(max_prefill_tokens, 2048)
    reserved = 512 + activation_tokens * 1.5 + tp * pp / 8 * 1024
    if decode_graphs:
        reserved += cuda_graph_max_bs * 2
    if prefill_graphs:
        if mla:
            reserved += 1.5 * 1024
        else:
            cap = chunked_prefill_size if prefill_graph_max_bs is None else prefill_graph_max_bs
            reserved += len(sglang_prefill_graph_sizes(cap)) * 8
    if gpu_mem_mib is not None and gpu_mem_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return reserved


def sglang_default_mem_fraction_static(gpu_mem_mib: int | None, *, chunked_prefill_size: int, tp: int = 1,
                                       pp: int = 1, mla: bool = False, cuda_graph_max_bs: int,
                                       prefill_graphs: bool = True, **kw) -> float:
    if gpu_mem_mib is None:
        return 0.95
    reserved = sglang_reserved_mib(gpu_mem_mib, chunked_prefill_size=chunked_prefill_size, tp=tp, pp=pp,
                                   mla=mla, cuda_graph_max_bs=cuda_graph_max_bs,
                                   prefill_graphs=prefill_graphs, **kw)
    return round((gpu_mem_mib - reserved) / gpu_mem_mib, 3)


def sglang_default_max_running_requests(max_total_num_tokens: int, context_len: int,
                                        user_value: int | None = None, *, dp: int = 1) -> int:
    """`kv_cache_configurator.py::resolve_max_num_reqs` (0.5.23 L3119-3172), per DP worker."""
    if user_value is not None:
        return min(max(1, user_value // dp), max_total_num_tokens // 2)
    estimated = max(min(int(max_total_num_tokens / context_len * 512), 4096), 2048)
    return min(estimated, max_total_num_tokens // 2)


def sglang_max_req_input_len(context_len: int, max_total_num_tokens: int) -> int:
    """`tp_worker.py::get_worker_info`: min(context_len - 1, pool - 1) - 5."""
    return min(context_len - 1, max_total_num_tokens - 1) - 5


def sglang_default_page_size(geom: ModelGeometry) -> int:
    """1 on CUDA (overrides.py `_page_size_default`); DSA models need 64-token pages (seed 002)."""
    return 64 if geom.indexer_layers else 1


@dataclass
class SglangBudget:
    total_bytes: int | None
    fraction: float | None  # mem_fraction_static used
    fraction_source: str  # "default formula" | "--mem-fraction-static"
    reserved_mib: float | None  # None when the fraction was given
    weights: int
    kv_pool_bytes: int | None
    kv_pool_bytes_upper: int | None
    cell_size: int
    max_total_num_tokens: int
    profiled_tokens: int | None
    page_size: int
    max_running_requests: int
    chunked_prefill_size: int
    cuda_graph_max_bs: int
    max_req_input_len: int
    context_len: int
    estimates: dict[str, int] = field(default_factory=dict)
    refusal: str | None = None  # SGLang's start-up refusal (sglang_budget(refuse=False)): no pool at all
    # a hybrid sliding-window model's pools (sglang_pools); None: one pool over every layer
    pools: SglangPools | None = None


def sglang_budget(geom: ModelGeometry, kv: KVBytes, *, weights: int, gpu_memory_bytes: int | None,
                  context_len: int, mem_fraction_static: float | None = None,
                  chunked_prefill_size: int | None = None, page_size: int | None = None,
                  max_total_tokens: int | None = None, max_running_requests: int | None = None,
                  tp: int = 1, pp: int = 1, dp: int = 1,
                  estimates: dict[str, int] | None = None, refuse: bool = True,
                  model_config: dict | None = None, hybrid_opts: SglangOptions | None = None,
                  kv_cache_dtype: str = "auto") -> SglangBudget:
    """KV pool = T x mfs - W - other. SGLang takes T as the *free* memory before the weights load;
    we assume an empty card (free = total) unless estimates["other_bytes"] says what else is there.
    Where SGLang would refuse to start (no memory left for the pool) this raises its message; with
    `refuse=False` the budget is returned with `refusal` set and an empty pool, so a ledger can
    show every number that leads there. A hybrid model (`model_config` and `hybrid_opts` given) is
    pooled as SGLang pools it (`sglang_hybrid_layout`): a sliding-window model's full and window
    pools come from the same byte budget (sglang_pools.sglang_pools)."""
    layout = sglang_hybrid_layout(geom, model_config, hybrid_opts, pp)
    estimates = dict(estimates or {})
    other = estimates.pop("other_bytes", 0)
    if estimates:
        raise ConfigError(f"SGLang has no estimate(s) {sorted(estimates)}; its reserve is a formula "
                          "(only other_bytes applies)", key="estimates")
    mib = None if gpu_memory_bytes is None else gpu_memory_bytes // MIB
    tier_cps, max_bs = sglang_gpu_tier(mib, tp=tp)
    cps = tier_cps if chunked_prefill_size is None else chunked_prefill_size
    if max_running_requests is not None:
        max_bs = min(max_bs, max_running_requests)  # decode max_bs capped when it was defaulted
    page = page_size or sglang_default_page_size(geom)
    reserved = None
    if mem_fraction_static is not None:
        fraction, how = mem_fraction_static, "--mem-fraction-static"
        if not 0 < fraction < 1:
            raise ConfigError(f"expected 0 < mem_fraction_static < 1, got {fraction}",
                              key="mem_fraction_static")
    else:
        mla = geom.attention == "mla"
        graph_cap = min(8192, cps) if mla else cps
        if max_total_tokens is not None:
            graph_cap = min(graph_cap, max_total_tokens)
        reserved = sglang_reserved_mib(mib, chunked_prefill_size=cps, tp=tp, pp=pp, mla=mla,
                                       cuda_graph_max_bs=max_bs, prefill_graph_max_bs=graph_cap)
        fraction, how = sglang_default_mem_fraction_static(
            mib, chunked_prefill_size=cps, tp=tp, pp=pp, mla=mla, cuda_graph_max_bs=max_bs,
            prefill_graph_max_bs=graph_cap), "default formula"
    kv_bytes = profiled = None
    if gpu_memory_bytes is not None:
        # kv_cache_configurator.py::_profile_available_bytes, in GiB floats as SGLang does it.
        free_gb = (gpu_memory_bytes - other) / GIB
        rest_gb = (free_gb - weights / GIB) - free_gb * (1 - fraction)
        if rest_gb <= 0:
            need = math.ceil((1 - (free_gb - weights / GIB) / free_gb) * 1000) / 1000
            refusal = (f"Loaded weights leave no GPU memory for the KV cache under "
                       f"--mem-fraction-static={fraction}. Raise --mem-fraction-static above "
                       f"{need:.3f} (weights {format_bytes(weights)} per rank)")
            if refuse:
                raise ConfigError(refusal)
            return SglangBudget(gpu_memory_bytes, fraction, how, reserved, weights, None, None, kv.total, 0, 0,
                                page, 0, cps, max_bs, 0, context_len, {"other_bytes": other} if other else {},
                                refusal)
        kv_bytes = int(rest_gb * GIB)
    if layout is not None:  # the full and window pools from the same bytes
        return _sglang_hybrid_budget(geom, model_config, hybrid_opts, kv_bytes, kv_cache_dtype, context_len,
                                     max_total_tokens, page, cps, max_running_requests, tp, dp,
                                     (gpu_memory_bytes, fraction, how, reserved, weights, max_bs, other))
    if kv_bytes is not None:
        profiled = kv_bytes // kv.total // page * page  # pool_configurator.calculate_pool_sizes
        tokens = profiled if max_total_tokens is None else min(profiled, max_total_tokens) // page * page
    elif max_total_tokens is not None:
        tokens = max_total_tokens // page * page
    else:
        raise ConfigError("the GPU memory is needed to size the KV pool (give --gpu-memory or "
                          "--max-total-tokens)", key="gpu_memory")
    if tokens <= 0:
        raise ConfigError(f"Not enough memory. Please try to increase --mem-fraction-static. "
                          f"Current value: mem_fraction_static={fraction}")
    mrr = sglang_default_max_running_requests(tokens, context_len, max_running_requests, dp=dp)
    return SglangBudget(gpu_memory_bytes, fraction, how, reserved, weights, kv_bytes, kv_bytes,
                        kv.total, tokens, profiled, page, mrr, cps, max_bs,
                        sglang_max_req_input_len(context_len, tokens), context_len,
                        {"other_bytes": other} if other else {})


def _sglang_hybrid_budget(geom, model_config, opts, kv_bytes, kv_cache_dtype, context_len, max_total_tokens, page,
                          cps, max_running_requests, tp, dp, split) -> SglangBudget:
    """The pools SGLang sizes from the same KV bytes: full and window (HybridSWAPoolConfigurator, or
    SWARequestCapPoolConfigurator with the radix cache off and --max-running-requests), or the
    recurrent-state slots first and the full pool from the rest (_handle_max_mamba_cache)."""
    total, fraction, how, reserved, weights, max_bs, other = split
    opts = dataclasses.replace(opts, tp=tp, dp=dp, page_size=page, chunked_prefill_size=cps,
                               max_running_requests=max_running_requests)
    pools = sglang_pools(model_config, geom, context_len=context_len, rest_bytes=kv_bytes,
                         max_total_tokens=max_total_tokens, kv_cache_dtype=kv_cache_dtype, opts=opts)
    profiled = None
    if kv_bytes is not None:
        profiled = sglang_pools(model_config, geom, context_len=context_len, rest_bytes=kv_bytes,
                                kv_cache_dtype=kv_cache_dtype, opts=opts).max_total_num_tokens
    tokens = pools.max_total_num_tokens
    return SglangBudget(total, fraction, how, reserved, weights, kv_bytes, kv_bytes, pools.full_bytes_per_token,
                        tokens, profiled, page, pools.max_running_requests, cps, max_bs,
                        sglang_max_req_input_len(context_len, tokens), context_len,
                        {"other_bytes": other} if other else {}, pools=pools)
