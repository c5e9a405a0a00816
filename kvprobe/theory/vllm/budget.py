"""Memory budget -> KV pool, as vLLM sizes it: measure, then split.

With total memory T, weights W, activation peak A, CUDA graphs G and other residents O (CUDA
context, NCCL buffers):

    K = ceil(T * gpu_memory_utilization) - W - O - A - G     (A measured, G estimated)

vLLM measures A, G and O on the GPU at startup (vllm/v1/worker/gpu_worker.py
`determine_available_memory`); kvprobe can only estimate them, so every estimate is a named
function below, reported in `VllmBudget.estimates` and replaceable through
`estimates={"activation_bytes": ..., "cudagraph_bytes": ..., "other_bytes": ...}`. The upper
bound (`kv_pool_bytes_upper`) subtracts weights only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvprobe.errors import ConfigError
from kvprobe.releases import VLLM_DEFAULT_VERSION
from kvprobe.theory.model.geometry import KVBytes, ModelGeometry, rope_cache_bytes
from kvprobe.theory.model.sizes import MIB, cdiv
from kvprobe.theory.vllm.hybrid.kv_cache_planning import (
    NO_KV_MEMORY,
    VllmKVPlan,
    not_enough_kv_memory,
    plan_layout,
    vllm_kv_plan,
)
from kvprobe.theory.vllm.hybrid.kv_cache_spec import MAMBA_SPEC, VllmOptions
from kvprobe.theory.vllm.memory_profile import (
    ProfileRules,
    graph_estimate_is_zero,
    graphs_profiled,
    non_torch_bytes,
    profile_rules,
    sampler_warmup_bytes,
)
from kvprobe.theory.vllm.releases import default_block_size, legacy_kv_size_line, vllm_default_gpu_memory_utilization


def estimate_vllm_other_bytes(*, tp: int = 1, pp: int = 1) -> int:
    """CUDA context + cuBLAS workspaces + allocator slack vLLM counts in `total_consumed`.

    A typical H100 process holds ~0.5 GiB before any tensor; NCCL buffers add ~0.25 GiB when
    the rank talks to others. Rough by nature: override with estimates["other_bytes"].
    """
    return 512 * MIB + (256 * MIB if tp * pp > 1 else 0)


def estimate_vllm_activation_bytes(geom: ModelGeometry, *, max_num_batched_tokens: int,
                                   max_num_seqs: int, tp: int = 1) -> int:
    """Peak of the profile run (a forward of max_num_batched_tokens tokens + a sampler run), as
    kvprobe estimates it for 0.33.0 (the releases read in memory_profile.py take the larger of the
    forward and the sampler warm-up instead: they run one after the other).

    Forward: the widest live intermediates of one layer (gate_up output, its activation and the
    residual stream, in the model dtype). Sampler: fp32 logits of max_num_seqs rows, with one copy
    for the softmax. Override with estimates["activation_bytes"].
    """
    sampler = max_num_seqs * geom.vocab_size * 4 * 2
    return estimate_vllm_forward_bytes(geom, max_num_batched_tokens=max_num_batched_tokens, tp=tp) + sampler


def estimate_vllm_forward_bytes(geom: ModelGeometry, *, max_num_batched_tokens: int, tp: int = 1,
                                top_k: int = 8) -> int:
    """The forward of the profile run: the widest live intermediates of one layer. Routed experts: the
    fused-MoE caches hold top_k rows per token (fused_moe.py intermediate_cache1 `(M, top_k, N)`); the
    releases read in memory_profile.py take the checkpoint's num_experts_per_tok, 0.33.0 keeps 8."""
    parts = {p.name: p for p in geom.weight_parts}
    widest = geom.hidden_size * 4
    for name in ("mlp.gate_up_proj", "shared_experts.gate_up_proj"):
        if name in parts:
            widest = max(widest, parts[name].params // geom.hidden_size // tp)
    if "experts.gate_up_proj" in parts:  # routed experts: each token goes to top_k of them
        gate_up = parts["experts.gate_up_proj"]  # MXFP4 parts count their biases: use the width itself
        mxfp4 = gate_up.special.startswith("mxfp4_")
        per_expert = gate_up.dims[0] * 2 * gate_up.dims[2] if mxfp4 else gate_up.params // geom.hidden_size
        widest = max(widest, per_expert // max(1, _n_experts(geom)) * top_k // tp)
    return max_num_batched_tokens * (widest * 3 // 2 + 4 * geom.hidden_size) * geom.dtype_bytes


def estimate_profiled_activation_bytes(geom: ModelGeometry, rules: ProfileRules, *, max_num_batched_tokens: int,
                                       max_num_seqs: int, tp: int = 1, pp: int = 1, gpu_arch: str = "sm90",
                                       gpu_sms: int | None = None) -> int:
    """The torch peak increase of profile_run as the release computes it: the forward, then the
    sampler warm-up (memory_profile.sampler_warmup_bytes), whichever is larger; 0.33.0: kvprobe's sum."""
    if rules.legacy:
        return estimate_vllm_activation_bytes(geom, max_num_batched_tokens=max_num_batched_tokens,
                                              max_num_seqs=max_num_seqs, tp=tp)
    forward = estimate_vllm_forward_bytes(geom, max_num_batched_tokens=max_num_batched_tokens, tp=tp,
                                          top_k=geom.experts_per_token or 8)
    return max(forward, sampler_warmup_bytes(geom, rules, max_num_seqs=max_num_seqs,
                                             max_num_batched_tokens=max_num_batched_tokens, gpu_arch=gpu_arch,
                                             gpu_sms=gpu_sms, pp=pp))


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


def vllm_capacity_numbers(num_blocks: int, block_size: int, max_model_len: int,
                          version: str = VLLM_DEFAULT_VERSION) -> tuple[int, float]:
    """(num_tokens, max_concurrency) of `GPU KV cache size: N tokens, Maximum concurrency ...`.

    vLLM 0.33.0 `kv_cache_utils.py::get_max_concurrency_for_kv_cache_config` /
    `get_kv_cache_capacity` for one full-attention group: concurrency = num_blocks (null block
    included) / cdiv(max_model_len, block_size); tokens = int(concurrency * max_model_len), or before
    0.20.1 the size line of one group (`legacy_size_line_tokens`).
    """
    per_request = cdiv(max_model_len, block_size)
    concurrency = num_blocks / per_request
    if legacy_kv_size_line(version):
        return legacy_size_line_tokens(num_blocks, [block_size]), concurrency
    return int(concurrency * max_model_len), concurrency


def legacy_size_line_tokens(num_blocks: int, block_sizes: list[int]) -> int:
    """"GPU KV cache size" before 0.20.1: num_blocks // groups x the smallest block size
    (kv_cache_utils.py `_report_kv_cache_config`, L1299-1303 in 0.18.1; releases.KV_SIZE_LINE_FROM)."""
    return num_blocks // len(block_sizes) * min(block_sizes)


def vllm_check_fits(num_blocks: int, bytes_per_block: int, block_size: int, max_model_len: int,
                    available_bytes: int) -> None:
    """`_check_enough_kv_cache_memory` (kv_cache_planning.py L50-87): refuse at startup when one
    request of max_model_len does not fit the usable blocks (the null block excluded)."""
    if available_bytes <= 0 or num_blocks <= 0:
        raise ConfigError(NO_KV_MEMORY)
    needed_blocks = cdiv(max_model_len, block_size)
    if num_blocks - 1 >= needed_blocks:
        return
    estimated = max(0, (num_blocks - 1) * block_size)
    raise ConfigError(not_enough_kv_memory(max_model_len, needed_blocks * bytes_per_block, available_bytes, estimated))


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
    # "profiled" | "kv_cache_memory_bytes" | "num_gpu_blocks_override" | "reservation" (0.34.0's extensible
    # KV cache: the profiled split only reserves, the pool is measured after warm-up)
    source: str
    estimates: dict[str, int] = field(default_factory=dict)  # the non-KV terms that were estimated
    # vLLM's start-up refusal text when it would not start with this pool (vllm_budget(refuse=False)),
    # and the largest max_model_len the pool holds: (num_blocks - 1) x block_size, as vLLM's message says.
    refusal: str | None = None
    largest_max_model_len: int = 0
    # a hybrid model's groups (vllm/hybrid/kv_cache_planning.vllm_kv_plan); None: one uniform pool
    plan: VllmKVPlan | None = None
    # the release's memory-profile rules (memory_profile.py), and whether its CUDA-graph estimate
    # (`cudagraph` above) is subtracted or only logged
    rules: str = ""
    cudagraph_subtracted: bool = True

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1


@dataclass(frozen=True)
class MemorySplit:
    """What a release's `determine_available_memory` takes from the requested memory before the KV
    pool: the terms a GPU measures and kvprobe estimates (`estimates` override them)."""

    requested: int | None  # None: no GPU memory given
    weights: int  # with the rotary cache where the release measures it with them
    other: int  # non-torch memory
    activation: int  # the profile run's torch peak
    cudagraph: int  # the CUDA-graph estimate
    cudagraph_subtracted: bool
    used: dict  # the estimates kvprobe made (the terms not given)

    @property
    def kv_pool(self) -> int | None:
        if self.requested is None:
            return None
        graph = self.cudagraph if self.cudagraph_subtracted else 0
        return self.requested - self.weights - self.other - self.activation - graph


def vllm_memory_split(geom: ModelGeometry, *, weights: int, gpu_memory_bytes: int | None, fraction: float,
                      version: str | None, max_num_seqs: int, max_num_batched_tokens: int, tp: int = 1, pp: int = 1,
                      estimates: dict[str, int] | None = None, gpu_arch: str = "sm90",
                      gpu_sms: int | None = None, enforce_eager: bool = False) -> MemorySplit:
    """The memory profile of `version` (`memory_profile.profile_rules`): the ledger's budget and the
    shadow worker's `determine_available_memory` (kvprobe/targets/shadow/vllm/kvspec.py) both size
    the pool here, so a shadow with a declared GPU checks the ledger's arithmetic end to end."""
    estimates = estimates or {}
    rules = profile_rules(version or VLLM_DEFAULT_VERSION)
    if not rules.legacy:  # the releases read measure weights as allocated, the rotary cache with them
        weights += rope_cache_bytes(geom)
    used: dict[str, int] = {}
    other = estimates.get("other_bytes")
    if other is None:
        other = non_torch_bytes(rules, tp=tp, pp=pp,
                                graphs_profiled=graphs_profiled(rules, geom, enforce_eager=enforce_eager))
        other = used["other_bytes"] = estimate_vllm_other_bytes(tp=tp, pp=pp) if other is None else other
    act = estimates.get("activation_bytes")
    if act is None:
        act = used["activation_bytes"] = estimate_profiled_activation_bytes(
            geom, rules, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, tp=tp, pp=pp,
            gpu_arch=gpu_arch, gpu_sms=gpu_sms)
    graph = estimates.get("cudagraph_bytes")
    if graph is None:  # --enforce-eager: no graph profiled, none captured (gpu_worker.py, 0.18.1 L398)
        graph = used["cudagraph_bytes"] = 0 if enforce_eager or graph_estimate_is_zero(rules, geom) else \
            estimate_vllm_cudagraph_bytes(geom, max_num_seqs=max_num_seqs)
    requested = None
    if gpu_memory_bytes is not None:
        requested = rules.requested(gpu_memory_bytes, fraction)
    return MemorySplit(requested, weights, other, act, graph, rules.cudagraph == "subtracted", used)


def vllm_budget(geom: ModelGeometry, kv: KVBytes, *, weights: int, gpu_memory_bytes: int | None,
                max_model_len: int, gpu_memory_utilization: float | None = None,
                version: str | None = None, block_size: int | None = None,
                max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, tp: int = 1, pp: int = 1,
                kv_cache_memory_bytes: int | None = None, num_gpu_blocks_override: int | None = None,
                estimates: dict[str, int] | None = None, auto_fit: bool = False,
                refuse: bool = True, plan_opts: VllmOptions | None = None, gpu_arch: str = "sm90",
                gpu_sms: int | None = None, enforce_eager: bool = False, extensible: bool = False) -> VllmBudget:
    """Pool of one worker. `auto_fit` = `--max-model-len auto`: shrink max_model_len to fit. `extensible`:
    0.34.0's extensible KV cache, whose profile run only reserves (utilisation 1.0 unless given); the pool it
    measures after warm-up is not modelled (theory/vllm/unmodelled.py V16), the reservation is what is shown.

    Where vLLM would refuse to start (one max_model_len request does not fit the pool), this raises
    its message as a ConfigError; with `refuse=False` the budget is returned with `refusal` set, so
    a ledger can still show every number that leads to the refusal.

    A hybrid model (window, chunked-local or linear layers) is planned by `vllm/hybrid/kv_cache_planning.vllm_kv_plan`
    with `plan_opts` (the engine settings its layout depends on): its groups share one pool whose
    block is the largest group's page, and the capacity line divides by the sum over groups
    (`VllmBudget.plan`). The terms of the split follow the release's own memory profile
    (`memory_profile.profile_rules(version)`)."""
    if geom.layers.hybrid and plan_opts is None:
        raise ConfigError(f"{geom.name} has {geom.layers.describe()} layers: its vLLM pool needs the "
                          "hybrid plan's options (vllm_budget(plan_opts=...))", key=geom.layers.key or "layer_types")
    estimates = dict(estimates or {})
    unknown = set(estimates) - {"activation_bytes", "cudagraph_bytes", "other_bytes"}
    if unknown:
        raise ConfigError(f"unknown estimate(s) {sorted(unknown)}; expected activation_bytes, "
                          "cudagraph_bytes, other_bytes", key="estimates")
    block = block_size or default_block_size(version or VLLM_DEFAULT_VERSION, mla=geom.attention == "mla")
    bytes_per_block = kv.total * block  # layers_on_rank x page bytes (MLA: one latent, no factor 2)
    if geom.layers.hybrid:
        _, layout, bytes_per_block, _, _ = plan_layout(geom, plan_opts, max_model_len)
        block = layout[0].block_size if layout[0].spec != MAMBA_SPEC else \
            next((g.block_size for g in layout if g.spec != MAMBA_SPEC), layout[0].block_size)
    fraction = gpu_memory_utilization if gpu_memory_utilization is not None else \
        vllm_default_gpu_memory_utilization(version, extensible=extensible)
    if not 0 < fraction <= 1:
        raise ConfigError(f"expected 0 < gpu_memory_utilization <= 1, got {fraction}",
                          key="gpu_memory_utilization")
    rules = profile_rules(version or VLLM_DEFAULT_VERSION)
    split = vllm_memory_split(geom, weights=weights, gpu_memory_bytes=gpu_memory_bytes, fraction=fraction,
                              version=version, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, tp=tp, pp=pp, estimates=estimates,
                              gpu_arch=gpu_arch, gpu_sms=gpu_sms, enforce_eager=enforce_eager)
    weights, other, act, graph, used = split.weights, split.other, split.activation, split.cudagraph, split.used

    requested = upper = upper_blocks = upper_tokens = None
    # --kv-cache-memory-bytes replaces the memory split: no fraction is requested, nothing profiled.
    if gpu_memory_bytes is not None and kv_cache_memory_bytes is None:
        requested = split.requested
        upper = requested - weights
        upper_blocks = max(0, upper // bytes_per_block)
        upper_tokens = max(0, upper // kv.total)
        if geom.layers.hybrid:  # the capacity line of the upper pool: blocks / blocks per request x length
            upper_tokens = int(upper_blocks / sum(g.blocks_per_request for g in layout) * max_model_len)
    if kv_cache_memory_bytes is not None:
        kv_pool, source = kv_cache_memory_bytes, "kv_cache_memory_bytes"
    elif requested is not None:
        kv_pool, source = split.kv_pool, "reservation" if extensible else "profiled"
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
    described = rules.describe() + ("; --enforce-eager: no CUDA graphs profiled or captured" if enforce_eager else "")
    if extensible:  # 0.34.0: the profile run's pool is a reservation (gpu_worker.py L796 logs it)
        described += ("; extensible KV cache: this is the reservation (utilisation "
                      f"{fraction:g}), the pool is measured after warm-up (not modelled)")
    if geom.layers.hybrid:
        split_only = VllmBudget(gpu_memory_bytes, fraction if kv_cache_memory_bytes is None else None, requested,
                                weights, other, act, graph, kv_pool, upper, bytes_per_block, num_blocks, upper_blocks,
                                block, 0, upper_tokens, max_model_len, 0.0, True, source, used, rules=described,
                                cudagraph_subtracted=rules.cudagraph == "subtracted")
        return _hybrid_budget(geom, plan_opts, max_model_len, auto_fit, refuse, num_gpu_blocks_override,
                              kv_pool, version or VLLM_DEFAULT_VERSION, split_only)
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
    fits = num_blocks - 1 >= cdiv(max_model_len, block)
    tokens, concurrency = vllm_capacity_numbers(max(num_blocks, 0), block, max_model_len,
                                                version or VLLM_DEFAULT_VERSION)
    return VllmBudget(gpu_memory_bytes, fraction if kv_cache_memory_bytes is None else None, requested,
                      weights, other, act, graph, kv_pool, upper, bytes_per_block, num_blocks,
                      upper_blocks, block, tokens, upper_tokens, max_model_len, concurrency, fits,
                      source, used, refusal, max(0, (num_blocks - 1) * block), rules=described,
                      cudagraph_subtracted=rules.cudagraph == "subtracted")


def plan_kv_tokens(plan: VllmKVPlan, version: str) -> int:
    """"GPU KV cache size: N tokens" of a hybrid plan as `version` prints it: int(max_concurrency x
    max_model_len) from 0.20.1, num_blocks // groups x the smallest block size before
    (theory/vllm/releases.py KV_SIZE_LINE_FROM)."""
    if not legacy_kv_size_line(version):
        return plan.kv_tokens
    return legacy_size_line_tokens(plan.num_blocks, [g.block_size for g in plan.groups])


def _hybrid_budget(geom: ModelGeometry, opts: VllmOptions, max_model_len: int, auto_fit: bool, refuse: bool,
                   override: int | None, kv_pool: int | None, version: str, split: VllmBudget) -> VllmBudget:
    """The memory split's pool planned as vLLM plans a hybrid model (vllm/hybrid/kv_cache_planning.vllm_kv_plan)."""
    plan = vllm_kv_plan(geom, max_model_len=max_model_len, available_bytes=None if override is not None
                        else kv_pool, num_gpu_blocks_override=override, opts=opts, auto_fit=auto_fit,
                        refuse=refuse)
    return dataclasses.replace(
        split, num_blocks=plan.num_blocks, block_size=plan.block_size, kv_tokens=plan_kv_tokens(plan, version),
        max_model_len=plan.max_model_len, max_concurrency_at_max_model_len=plan.max_concurrency,
        fits_max_model_len=plan.refusal is None, refusal=plan.refusal,
        largest_max_model_len=plan.largest_max_model_len, plan=plan)

