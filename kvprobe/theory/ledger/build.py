"""The capacity ledger of one configuration, built: the model's geometry and weights, the engine's
memory budget, the pool's capacity, one request's blocks and the admission limit, each computed by
the engine's own theory (`kvprobe.theory.vllm`, `kvprobe.theory.sglang`). The data is
`kvprobe.theory.ledger.sections.Ledger`; `kvprobe.theory.ledger.text` renders it."""

from __future__ import annotations

from kvprobe.errors import ConfigError
from kvprobe.releases import SGLANG_DEFAULT_VERSION, VLLM_DEFAULT_VERSION
from kvprobe.theory import admission, schedsim
from kvprobe.theory.ledger.inputs import LedgerInputs, normalized, validate
from kvprobe.theory.ledger.rules import ReleaseRules, sglang_release_rules, vllm_release_rules
from kvprobe.theory.ledger.sections import Capacity, Ledger, ModelSection, RequestSection
from kvprobe.theory.model.geometry import (
    ModelGeometry,
    geometry_from_config,
    kv_bytes_per_token,
    load_model_config,
    weight_bytes,
)
from kvprobe.theory.model.layers import LINEAR
from kvprobe.theory.model.mxfp4 import DEFAULT_GPU_ARCH
from kvprobe.theory.model.sizes import cdiv
from kvprobe.theory.sglang.budget import sglang_budget
from kvprobe.theory.sglang.pools import (
    DEFAULT_MAMBA_FULL_MEMORY_RATIO,
    DEFAULT_SWA_FULL_TOKENS_RATIO,
    SglangOptions,
    SglangPools,
)
from kvprobe.theory.sglang.releases import MAX_PREFILL_TOKENS, scheduler_rules
from kvprobe.theory.sglang.schedule_policy import CLIP_MAX_NEW_TOKENS
from kvprobe.theory.sglang.swa.request import FULL_POOL, window_pool_label
from kvprobe.theory.vllm.batch import vllm_batch_sizes
from kvprobe.theory.vllm.budget import vllm_budget
from kvprobe.theory.vllm.hybrid.groups import group_label, group_layers, sched_groups
from kvprobe.theory.vllm.hybrid.kv_cache_spec import VllmOptions, card_capability, release_options
from kvprobe.theory.vllm.releases import (
    active_seqs_refusal,
    default_block_size,
    extensible_kv_cache,
    extensible_kv_cache_refusal,
    kv_cache_memory_refusal,
    mamba_align_block_refusal,
    running_cap,
    watermark_refusal,
    window_rules,
)

__all__ = ["Ledger", "LedgerInputs", "build_ledger"]

MAMBA_POOL = "mamba state slots"  # SGLang's recurrent-state pool (Qwen3-Next), as the ledger names it

def build_ledger(inputs: LedgerInputs, *, explain_refusal: bool = False) -> Ledger:
    """The ledger of one configuration. Where the engine would refuse to start, this raises its
    message as a ConfigError; with `explain_refusal` the ledger is returned with every table and the
    refusal as a finding (`Ledger.refusal`, `Ledger.startup`), and no admission prediction."""
    inputs = normalized(inputs)
    validate(inputs)
    cfg, source = load_model_config(inputs.model, base_dir=inputs.base_dir)
    cfg = with_quantization(cfg, inputs.quantization, source)
    geom = geometry_from_config(cfg, inputs.model, dtype=inputs.dtype, source=source)
    kv = kv_bytes_per_token(geom, kv_cache_dtype=inputs.kv_cache_dtype, tp=inputs.tp, pp=inputs.pp)
    model = ModelSection(geom, kv, weight_bytes(geom, tp=inputs.tp, pp=inputs.pp, engine=inputs.engine,
                                                    gpu_arch=inputs.gpu_arch or DEFAULT_GPU_ARCH,
                                                    ep=expert_parallel_size(inputs)), source, cfg)
    if inputs.engine == "vllm":
        return _build_vllm(inputs, model, refuse=not explain_refusal)
    return _build_sglang(inputs, model, refuse=not explain_refusal)


def _vllm_free_memory_refusal(inputs: LedgerInputs, version: str) -> str | None:
    """vLLM's start-up check on a shared card (memory_profile.free_memory_refusal): its pool is the card's
    total x utilization whatever others hold, so the free memory only decides whether it starts at all."""
    if inputs.gpu_free_memory_bytes is None or inputs.gpu_memory_bytes is None:
        return None
    from kvprobe.theory.vllm.memory_profile import free_memory_refusal, profile_rules

    rules = profile_rules(version)
    fraction = inputs.gpu_memory_utilization or rules.gpu_memory_utilization
    return free_memory_refusal(version, total=inputs.gpu_memory_bytes, free=inputs.gpu_free_memory_bytes,
                               fraction=fraction, requested=rules.requested(inputs.gpu_memory_bytes, fraction))


def expert_parallel_size(inputs: LedgerInputs) -> int:
    """vLLM's EP degree: with --enable-expert-parallel and more than one TP x DP rank, the MoE layers run
    with ep_size = TP x DP and no TP of their own (0.29.0 `fused_moe/config.py` L1212-1256); else 1 (SGLang's
    expert parallelism is its own flags, not read)."""
    return inputs.tp * inputs.dp if inputs.enable_expert_parallel and inputs.engine == "vllm" else 1


def with_quantization(cfg: dict, method: str | None, source: str) -> dict:
    """The checkpoint as `--quantization` has the engine load it. `fp8` on a 16-bit checkpoint quantises
    its linear layers online to FP8 with one scale per tensor (vllm model_executor/layers/quantization/
    fp8.py Fp8LinearMethod, `is_checkpoint_fp8_serialized` False): counted as a per-tensor FP8 checkpoint.
    A method that names the checkpoint's own is a no-op; another is refused, as vLLM refuses it."""
    if method is None:
        return cfg
    own = str(((cfg.get("quantization_config") or {}) if isinstance(cfg.get("quantization_config"), dict)
               else {}).get("quant_method", "")).lower()
    if own:
        if own != method.lower():
            raise ConfigError(f"the checkpoint is quantised with {own!r} ({source}: quantization_config."
                              f"quant_method); --quantization {method} does not match it", key="quantization")
        return cfg
    if method.lower() != "fp8":
        raise ConfigError(f"expected fp8 (online FP8) for a checkpoint without quantization_config, got "
                          f"{method!r}: kvprobe does not count that method's weights", key="quantization")
    return {**cfg, "quantization_config": {"quant_method": "fp8"}}


def _derived_len(inputs: LedgerInputs, geom: ModelGeometry, asked: int | None, key: str) -> int:
    if asked is None or asked == -1:
        return geom.max_position_embeddings
    if asked > geom.max_position_embeddings:
        raise ConfigError(f"{asked} is greater than the derived maximum length of the model "
                          f"(max_position_embeddings={geom.max_position_embeddings}); both engines refuse "
                          f"this unless their allow-longer environment variable is set", key=key)
    return asked


def _build_vllm(inputs: LedgerInputs, model: ModelSection, *, refuse: bool = True) -> Ledger:
    geom = model.geometry
    version = inputs.engine_version or VLLM_DEFAULT_VERSION
    # a flag this release's `vllm serve` lacks: the command line is parsed before anything else
    absent = [(key, text) for key, text in (
        ("watermark", watermark_refusal(version, inputs.watermark)),
        ("kv_cache_memory_bytes", kv_cache_memory_refusal(version, inputs.kv_cache_memory_bytes)),
        ("enable_extensible_kv_cache", extensible_kv_cache_refusal(version, inputs.enable_extensible_kv_cache)),
    ) if text]
    flag_refusal = absent[0][1] if absent else None
    if absent and refuse:
        raise ConfigError(flag_refusal, key=absent[0][0])
    extensible = extensible_kv_cache(version, inputs.enable_extensible_kv_cache,
                                     kv_cache_memory_bytes=inputs.kv_cache_memory_bytes,
                                     num_gpu_blocks_override=inputs.num_gpu_blocks_override)
    # vLLM checks it first, at worker init; not with the extensible KV cache (0.34.0 v1/worker/utils.py L759-762)
    startup = None if extensible else _vllm_free_memory_refusal(inputs, version)
    if startup is not None and refuse:
        raise ConfigError(startup, key="gpu_free_memory")
    max_len = _derived_len(inputs, geom, inputs.max_model_len, "max_model_len")
    seqs, tokens = vllm_batch_sizes(inputs.gpu_memory_bytes, max_len, max_num_seqs=inputs.max_num_seqs,
                                    max_num_batched_tokens=inputs.max_num_batched_tokens,
                                    gpu_name=inputs.gpu_name, version=version)
    # --max-num-active-seqs: refused before the release that has it, else a cap on RUNNING (releases.py)
    active_refusal = active_seqs_refusal(version, seqs, inputs.max_num_active_seqs)
    if active_refusal is not None and refuse:
        raise ConfigError(active_refusal, key="max_num_active_seqs")
    running = seqs if active_refusal else running_cap(seqs, inputs.max_num_active_seqs)
    caching = True if inputs.enable_prefix_caching is None else inputs.enable_prefix_caching
    plan_opts, window = None, window_rules(version)
    if geom.layers.hybrid:  # the engine settings a hybrid layout depends on (vllm/hybrid/kv_cache_spec.VllmOptions)
        plan_opts = VllmOptions(cache_dtype=inputs.kv_cache_dtype, block_size=inputs.block_size or
                                default_block_size(version), tp=inputs.tp, pp=inputs.pp, max_num_batched_tokens=tokens,
                                async_scheduling=bool(inputs.async_scheduling), enable_prefix_caching=caching,
                                **release_options(window, geom, inputs.gdn_prefill_backend,
                                                  card_capability(inputs.gpu_capability, inputs.gpu_arch)))
    bud = vllm_budget(
        geom, model.kv, weights=model.weight_bytes, gpu_memory_bytes=inputs.gpu_memory_bytes,
        max_model_len=max_len, gpu_memory_utilization=inputs.gpu_memory_utilization, version=version,
        block_size=inputs.block_size, max_num_seqs=seqs, max_num_batched_tokens=tokens, tp=inputs.tp,
        pp=inputs.pp, kv_cache_memory_bytes=inputs.kv_cache_memory_bytes,
        num_gpu_blocks_override=inputs.num_gpu_blocks_override, estimates=inputs.estimates,
        auto_fit=inputs.max_model_len == -1, refuse=refuse, plan_opts=plan_opts,
        gpu_arch=inputs.gpu_arch or DEFAULT_GPU_ARCH, gpu_sms=inputs.gpu_sms, enforce_eager=inputs.enforce_eager,
        extensible=extensible)
    mamba_refusal = None if plan_opts is None or not geom.layers.count(LINEAR) else mamba_align_block_refusal(
        version, align_mode=plan_opts.mamba_cache_mode == "align", block_size=bud.block_size,
        max_num_batched_tokens=tokens)
    if mamba_refusal is not None and refuse:
        raise ConfigError(mamba_refusal, key="max_num_batched_tokens")
    groups, not_modelled = (), None
    if bud.plan is not None:
        try:
            groups = sched_groups(bud.plan)
        except ConfigError as err:
            not_modelled = str(err)
    cap = Capacity(bud.num_blocks, bud.usable_blocks, bud.block_size, bud.bytes_per_block, bud.kv_tokens,
                   bud.kv_tokens_upper, bud.max_concurrency_at_max_model_len, bud.max_model_len, running, tokens,
                   _capacity_groups(bud.plan) if bud.plan is not None else [])
    request = None
    if inputs.prompt_tokens is not None:
        p, o, blk = inputs.prompt_tokens, inputs.output_tokens, bud.block_size
        if p + o > bud.max_model_len:
            raise ConfigError(f"prompt_tokens + output_tokens = {p + o} is beyond max_model_len "
                              f"{bud.max_model_len}; vLLM rejects such a request (HTTP 400)",
                              key="output_tokens")
        # admission needs the prompt's blocks; the last output's KV is never written (its token is
        # sampled, not run through the model: vllm/v1/core/sched/scheduler.py)
        request = RequestSection(p, o, cdiv(p, blk), cdiv(p + o - 1, blk), "blocks", bud.max_model_len)
    policy = inputs.policy or admission.policy_for("vllm", version, reserve_full_isl=inputs.reserve_full_isl)
    rules = vllm_release_rules(inputs, geom, bud, version=version, seqs=seqs, caching=caching,
                               policy=policy if request is not None else None, plan_opts=plan_opts)
    refusal = flag_refusal or active_refusal or startup or bud.refusal or mamba_refusal
    if refusal is not None:  # the engine would not start: nothing is admitted
        return _with_rules(Ledger(inputs, model, bud, cap, request, None, None, version, refusal), rules)
    if not_modelled is not None:
        return _with_rules(Ledger(inputs, model, bud, cap, None, None, None, version, not_predicted=not_modelled),
                           rules)
    if request is not None and rules.blocks_prediction:  # a release change the admission model lacks
        return _with_rules(Ledger(inputs, model, bud, cap, request, None, None, version,
                                  not_predicted=rules.why_not_predicted()), rules)
    sched = schedsim.VllmConfig(
        num_gpu_blocks=bud.num_blocks, block_size=bud.block_size, max_num_seqs=running,
        max_num_batched_tokens=tokens, max_model_len=bud.max_model_len,
        enable_prefix_caching=caching,
        enable_chunked_prefill=True, async_scheduling=bool(inputs.async_scheduling), watermark=inputs.watermark,
        policy=policy if policy.startswith("vllm") else admission.policy_for("vllm", version),
        groups=groups, window_admission_cap=window.admission_cap, window_in_flight=window.in_flight,
        sparse_retention=window.sparse_retention, free_order=window.free_order)
    layers = tuple(group_layers(bud.plan)) if groups else ()
    pred = _predict(sched, inputs, policy, request, layers)
    return _with_rules(Ledger(inputs, model, bud, cap, request, pred, sched, version), rules)


def _with_rules(led: Ledger, rules: ReleaseRules) -> Ledger:
    """The ledger naming the release rules it applied and the changes it has no model for here."""
    led.release_rules, led.not_modelled = list(rules.applied), rules.lines
    return led


def _build_sglang(inputs: LedgerInputs, model: ModelSection, *, refuse: bool = True) -> Ledger:
    geom = model.geometry
    version = inputs.engine_version or SGLANG_DEFAULT_VERSION
    ctx = _derived_len(inputs, geom, inputs.context_length or inputs.max_model_len, "context_length")
    bud = sglang_budget(
        geom, model.kv, weights=model.weight_bytes, gpu_memory_bytes=inputs.gpu_memory_bytes,
        context_len=ctx, mem_fraction_static=inputs.mem_fraction_static,
        chunked_prefill_size=inputs.chunked_prefill_size, page_size=inputs.page_size,
        max_total_tokens=inputs.max_total_tokens, max_running_requests=inputs.max_running_requests,
        tp=inputs.tp, pp=inputs.pp, dp=inputs.dp, estimates=inputs.estimates, refuse=refuse,
        model_config=model.config, kv_cache_dtype=inputs.kv_cache_dtype, version=version,
        gpu_free_bytes=inputs.gpu_free_memory_bytes, disable_piecewise_cuda_graph=inputs.disable_piecewise_cuda_graph,
        disable_cuda_graph=inputs.disable_cuda_graph,
        hybrid_opts=SglangOptions(swa_full_tokens_ratio=inputs.swa_full_tokens_ratio or DEFAULT_SWA_FULL_TOKENS_RATIO,
                                  disable_radix_cache=inputs.disable_radix_cache,
                                  disable_overlap_schedule=inputs.disable_overlap_schedule,
                                  mamba_radix_cache_strategy=inputs.mamba_radix_cache_strategy or "extra_buffer",
                                  disable_hybrid_swa_memory=inputs.disable_hybrid_swa_memory,
                                  max_mamba_cache_size=inputs.max_mamba_cache_size,
                                  mamba_full_memory_ratio=(inputs.mamba_full_memory_ratio
                                                           or DEFAULT_MAMBA_FULL_MEMORY_RATIO),
                                  mamba_ssm_dtype=inputs.mamba_ssm_dtype))
    m, page = bud.max_total_num_tokens, bud.page_size
    cap = Capacity(m // page, m // page, page, bud.cell_size * page, m, bud.profiled_tokens, m / ctx, ctx,
                   bud.max_running_requests, bud.chunked_prefill_size,
                   sglang_pool_groups(bud.pools) if bud.pools else [])
    policy = inputs.policy or admission.policy_for("sglang", version)
    rules = sglang_release_rules(inputs, bud, version=version, ctx=ctx,
                                 policy=policy if inputs.prompt_tokens is not None else None)
    if bud.refusal is not None:  # SGLang would not start: no pool, nothing admitted
        return _with_rules(Ledger(inputs, model, bud, cap, None, None, None, version, bud.refusal), rules)
    request = None
    if inputs.prompt_tokens is not None:
        p, o = inputs.prompt_tokens, inputs.output_tokens
        limit = min(ctx, m) - 2  # exactly O tokens need P + O <= min(ctx, M) - 2 (scheduler.py init_req_max_new_tokens)
        if p > bud.max_req_input_len or p + o > limit:
            raise ConfigError(f"prompt_tokens + output_tokens = {p + o} (prompt {p}) is beyond SGLang's "
                              f"length limit: P <= max_req_input_len {bud.max_req_input_len} and "
                              f"P + O <= min(context_len, pool) - 2 = {limit}", key="output_tokens")
        # reserved at admission: prompt + min(max_new_tokens, 4096) (clip_max_new_tokens_estimation)
        request = RequestSection(p, o, p + min(o, CLIP_MAX_NEW_TOKENS), p + o - 1, "tokens", limit)
    lay = bud.pools.layout if bud.pools else None
    not_modelled = _sglang_hybrid_not_modelled(inputs, lay)
    if not_modelled is not None:
        return _with_rules(Ledger(inputs, model, bud, cap, request, None, None, version,
                                  not_predicted=not_modelled if request is not None else None), rules)
    if request is not None and rules.blocks_prediction:  # a release change the admission model lacks
        return _with_rules(Ledger(inputs, model, bud, cap, request, None, None, version,
                                  not_predicted=rules.why_not_predicted()), rules)
    window = lay is not None and lay.pool == "hybrid_swa"  # Qwen3-Next, radix off: the plain scheduler
    #   on the full pool, max_running_requests = the state slots (tests/theory/test_real_sglang.py)
    sched = schedsim.SglangConfig(
        max_total_num_tokens=m, page_size=page, max_running_requests=bud.max_running_requests,
        chunked_prefill_size=bud.chunked_prefill_size,
        max_prefill_tokens=MAX_PREFILL_TOKENS, context_len=ctx,
        disable_radix_cache=inputs.disable_radix_cache, overlap=not inputs.disable_overlap_schedule,
        policy=policy if policy.startswith("sglang") else admission.policy_for("sglang", version),
        sliding_window_size=lay.sliding_window_size if window else None,
        swa_pool_tokens=bud.pools.swa_tokens if window else None, **scheduler_rules(version))
    layers = (len(lay.full_layer_ids), len(lay.swa_layer_ids)) if window else ()
    try:
        pred = _predict(sched, inputs, policy, request, layers)
    except admission.NotModelled as err:  # the radix cache on, a re-admission onto an old path
        return _with_rules(Ledger(inputs, model, bud, cap, request, None, sched, version, not_predicted=str(err)),
                           rules)
    return _with_rules(Ledger(inputs, model, bud, cap, request, pred, sched, version), rules)


def _sglang_hybrid_not_modelled(inputs: LedgerInputs, lay) -> str | None:
    """Why SGLang's admission of this hybrid layout is not predicted, or None. Modelled (and
    checked against SGLang's Scheduler, tests/theory/test_real_sglang.py): windows with the radix
    cache off, or on with no prompt prefix shared (sglang/swa/radix.py: until a retracted
    request comes back to its old tree path, which admission.NotModelled reports); Qwen3-Next with
    it off, or on with the no_buffer strategy (overlap off, pages of 1) when no prompt prefix is
    shared (its matches stop at cached states: not modelled)."""
    if lay is None or inputs.disable_radix_cache:
        return None
    if lay.pool == "hybrid_swa":
        if inputs.shared_prefix_tokens:  # a shared prefix's window slots in the unified tree: not modelled
            return ("a shared prompt prefix on SGLang's hybrid sliding-window radix cache (a prefix matches "
                    "only with a live window of slots) is not modelled; add --disable-radix-cache or drop "
                    "the shared prefix")
        return None
    if inputs.mamba_radix_cache_strategy != "no_buffer":
        return ("SGLang's recurrent-state (Mamba) admission is modelled with the radix cache off, or on with "
                "--mamba-radix-cache-strategy no_buffer (and --disable-overlap-schedule); add --disable-radix-cache")
    if inputs.shared_prefix_tokens:
        return ("a shared prompt prefix on Qwen3-Next's radix cache (matches stop at cached recurrent states) "
                "is not modelled; add --disable-radix-cache or drop the shared prefix")
    return None


def _predict(sched, inputs: LedgerInputs, policy: str, request: RequestSection | None,
             layers: tuple[int, ...] = ()):
    if request is None:
        return None
    pred = admission.predict(sched, request.prompt_tokens, request.output_tokens, inputs.users,
                                 policy=policy, shared_prefix_tokens=inputs.shared_prefix_tokens,
                                 **({"layers": layers} if layers else {}))
    # The admission model owns the per-request accounting; keep the request section consistent.
    request.blocks_admission, request.blocks_peak = pred.blocks_admission, pred.blocks_peak
    request.groups = list(getattr(pred, "groups", ()))
    return pred


def sglang_pool_groups(pools: SglangPools) -> list[dict]:
    """SGLang's hybrid sliding-window pools for the capacity table: each pool's tokens, layers and
    bytes per token (all its layers, this rank)."""
    lay = pools.layout
    full = {"group": FULL_POOL, "kind": "full", "copies": 1, "layers": len(lay.full_layer_ids),
            "tokens": pools.max_total_num_tokens, "bytes_per_token": pools.full_bytes_per_token}
    if lay.pool == "mamba":  # one state slot per running request (radix off)
        return [full, {"group": MAMBA_POOL, "kind": "mamba", "copies": 1, "layers": len(lay.mamba_layer_ids),
                       "slots": pools.mamba_slots, "bytes_per_slot": lay.mamba_cache_per_req}]
    return [full, {"group": window_pool_label(lay.sliding_window_size), "kind": "sliding", "copies": 1,
                   "layers": len(lay.swa_layer_ids), "tokens": pools.swa_tokens,
                   "bytes_per_token": pools.swa_bytes_per_token}]


def _capacity_groups(plan) -> list[dict]:
    """The plan's groups for the capacity table, merged as the scheduler runs them."""
    try:
        kinds = sched_groups(plan)
    except ConfigError:  # not simulated; the planner's own groups still show
        return [{"group": g.spec, "copies": 1, "layers": len(g.layers), "block_size": g.block_size,
                 "blocks_per_request": g.blocks_per_request} for g in plan.groups]
    out, it = [], iter(plan.groups)
    for g in kinds:
        members = [next(it) for _ in range(g.copies)]
        out.append({"group": group_label(g), "copies": g.copies, "layers": sum(len(m.layers) for m in members),
                    "block_size": members[0].block_size,
                    "blocks_per_request": sum(m.blocks_per_request for m in members)})
    return out
