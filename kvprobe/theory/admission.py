"""Admission limit of a fixed-length workload (P prompt, O output tokens, ignore_eos) per policy.

Closed forms where the engine's rule makes them exact (reservation engines), the step simulation
(`schedsim.closed_loop`) where the answer is a dynamic plateau (vLLM's preemption cycle, SGLang's
new_token_ratio drift). Formulas: shared/reference/vllm.md §3, shared/reference/sglang.md §3.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace

from kvprobe.errors import ConfigError
from kvprobe.theory.schedsim import (
    CLIP_MAX_NEW_TOKENS,
    SEM_STOP,
    ClosedLoopStats,
    SglangConfig,
    VllmConfig,
    cdiv,
    closed_loop,
)
from kvprobe.theory.sglang.swa.scheduler import (
    FULL_POOL,
    is_hybrid_swa,
    request_pool_tokens,
    window_pool_label,
)
from kvprobe.theory.vllm.hybrid.groups import no_preemption_limit, request_group_blocks
from kvprobe.theory.vllm.hybrid.scheduler import is_hybrid

POLICIES = ("vllm-0.33", "vllm-0.11", "sglang-0.5.22", "sglang-0.5.21", "worst-case")


def policy_for(engine: str, version: str, *, reserve_full_isl: bool = True) -> str:
    """The admission policy of an engine version (reserve_full_isl: vLLM's
    --scheduler-reserve-full-isl, which first appeared after 0.11)."""
    parts = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    if engine == "vllm":
        return "vllm-0.33" if parts > (0, 11, 0) and reserve_full_isl else "vllm-0.11"
    if engine == "sglang":
        return "sglang-0.5.22" if parts >= (0, 5, 22) else "sglang-0.5.21"
    raise ConfigError(f"unknown engine {engine!r}; expected vllm or sglang")


@dataclass(frozen=True)
class Prediction:
    policy: str
    limit: float  # admission limit: running plateau when saturated (int-valued for reservation engines)
    no_preemption_limit: int  # largest N with no waiting and no preemption/retraction
    binding: str  # "kv" | "max_num_seqs" | "max_running_requests" | "token_budget" | "length"
    usage_at_limit: float  # the engine's own usage gauge at the limit (0..1)
    blocks_admission: int  # vLLM: blocks needed to admit; SGLang: tokens reserved at admission
    blocks_peak: int  # vLLM: peak blocks of one request; SGLang: peak tokens held
    method: str  # "closed-form" | "schedsim"
    users: int | None = None
    running: float | None = None  # steady state at `users`
    waiting: float | None = None
    preemption_rate: float | None = None  # preemptions / retractions per 1000 steps at `users`
    limit_mean: float | None = None  # time-averaged running of the steady state behind `limit`
    how: str = ""  # how `limit` was obtained: the simulation's steps, lifetimes and standard error
    users_how: str = ""  # the same for running/waiting at `users`
    running_sem: float | None = None
    waiting_sem: float | None = None
    async_scheduling: bool | None = None  # vLLM: the scheduling mode simulated
    shared_prefix_tokens: int = 0
    start: str = ""  # "ramp" | "burst": the arrival history whose steady state gives `limit`
    probe_users: int | None = None  # the closed loop behind `limit`: its users and ramp width
    ramp_width: int | None = None
    # vLLM hybrid models: one request's blocks per KV cache group (vllm_hybrid_groups.GroupBlocks
    # as dicts), and the group holding most of them when KV binds ("full layers", ...)
    groups: tuple = ()
    binding_group: str = ""
    # Hybrid (vLLM): the largest N whose simulated closed loop (users ramped over a lifetime) never
    # waits or preempts. The groups peak at different moments, so it is above `no_preemption_limit`,
    # which holds whatever the arrivals' phase (every request at every group's peak at once) and is
    # what a probe is held to: users that start closer in phase find the clean region lower.
    clean_in_closed_loop: int | None = None
    clean_in_closed_loop_how: str = ""


class NotModelled(ConfigError):
    """The simulation left what is modelled (and checked against the engine): no prediction."""


def _check_modelled(stats) -> None:
    """SGLang hybrid SWA with the radix cache on is followed exactly until a retracted request is
    re-admitted onto its old prompt path (sched_sglang_swa_radix.py); a loop that does so is not
    a prediction."""
    if stats.swa_radix_readopted:
        raise NotModelled(
            f"with SGLang's radix cache on, {stats.swa_radix_readopted} retracted request(s) came back to their "
            "prompt still in the tree, which SGLang re-adopts by what its two LRUs evicted (not modelled); "
            "add --disable-radix-cache, or a workload that does not retract", key="disable_radix_cache")


def predict(config: VllmConfig | SglangConfig, prompt_tokens: int, output_tokens: int,
            users: int | None = None, *, policy: str | None = None, shared_prefix_tokens: int = 0,
            layers: tuple[int, ...] = ()) -> Prediction:
    """Admission limit (and the steady state at `users`) of fixed-length requests whose prompts
    share their first `shared_prefix_tokens` tokens (a system prompt; the rest unique). `layers`:
    a hybrid vLLM model's layer count per KV group (shown in the per-group breakdown)."""
    P, O, K = prompt_tokens, output_tokens, shared_prefix_tokens  # noqa: E741  (the references' names)
    if P < 1 or O < 1:
        raise ConfigError(f"prompt_tokens and output_tokens must be >= 1, got P={P} O={O}")
    if not 0 <= K < P:
        raise ConfigError(f"shared_prefix_tokens must be >= 0 and < prompt_tokens ({P}), got {K}",
                          key="shared_prefix_tokens")
    policy = policy or config.policy
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    if isinstance(config, VllmConfig):
        pred = _vllm(config, P, O, K, policy, layers)
    elif isinstance(config, SglangConfig):
        pred = _sglang(config, P, O, K, policy, layers)
    else:
        raise ConfigError(f"expected VllmConfig or SglangConfig, got {type(config).__name__}")
    if users is None:
        return pred
    start, width = _users_start(pred)
    stats = closed_loop(_with_policy(config, policy), P, O, users, shared_prefix_tokens=K, start=start,
                        ramp_width=min(users, width))
    _check_modelled(stats)
    return replace(pred, users=users, running=round(stats.running_mean, 2), waiting=round(stats.waiting_mean, 2),
                   preemption_rate=round(stats.preemptions_per_1k_steps, 2), running_sem=round(stats.running_sem, 3),
                   waiting_sem=round(stats.waiting_sem, 3), users_how=describe(stats, start))


def _users_start(pred: Prediction) -> tuple[str, int]:
    """The steady state at N users is simulated from the start that reaches the limit."""
    return pred.start or "ramp", _ramp_width(pred.limit)


def _ramp_width(estimate: float) -> int:
    """Users join `lifetime / width` steps apart: about one per running slot per lifetime, as a
    probe's ramp adds them (each first request meets a running batch at a different phase)."""
    return max(1, math.ceil(estimate) + 2)


def describe(stats: ClosedLoopStats, start: str) -> str:
    early = f" (stopped at SEM <= {SEM_STOP:.1%} of running)" if stats.stopped_early else ""
    return (f"schedsim, {start} start: {stats.simulated:,} steps, {stats.lifetimes:.0f} lifetimes of "
            f"{stats.lifetime:,} measured{early}, SEM {stats.running_sem:.2f}")


def _with_policy(config, policy: str):
    if policy == "worst-case" or policy == config.policy:
        return config
    return replace(config, policy=policy)


# --------------------------------------------------------------------------- vLLM


def vllm_request_blocks(P: int, O: int, B: int) -> tuple[int, int, float]:  # noqa: E741
    """(b_adm, b_max, b_avg) of one request: admit ceil(P/B); the KV of output O is never written,
    so the peak is ceil((P+O-1)/B); b_avg is the time average over its O steps (vllm.md §2.6)."""
    b_adm, b_max = cdiv(P, B), cdiv(P + O - 1, B)
    b_avg = (b_adm + sum(cdiv(P + k, B) for k in range(1, O))) / O
    return b_adm, b_max, b_avg


def vllm_shared_blocks(cfg: VllmConfig, K: int) -> int:
    """Blocks every request shares under prefix caching: the full blocks of the shared prefix
    (only full blocks are hashed, kv_cache_utils.py; the hit is capped at P - 1 tokens, K < P)."""
    return K // cfg.block_size if cfg.enable_prefix_caching else 0


def _vllm(cfg: VllmConfig, P: int, O: int, K: int, policy: str, layers=()) -> Prediction:  # noqa: E741
    B, U, S, T = cfg.block_size, cfg.num_gpu_blocks - 1, cfg.max_num_seqs, cfg.max_num_batched_tokens
    if P + O > cfg.max_model_len:  # 0.33 clamps max_tokens, then min_tokens=O is a 400 (vllm.md §4)
        raise ConfigError(f"P+O = {P + O} exceeds max_model_len {cfg.max_model_len} (binding: length)")
    b_adm, b_max, b_avg = vllm_request_blocks(P, O, B)
    groups: tuple = ()
    if cfg.groups and is_hybrid(cfg):  # the groups' blocks of one request, as the engine holds them
        per_group = request_group_blocks(cfg, P, O, list(layers))
        groups = tuple(dataclasses.asdict(g) for g in per_group)
        b_adm = sum(g.blocks_admission for g in per_group)
        b_max = max(1, sum(g.blocks_peak for g in per_group))
        b_avg = max(1.0, sum(g.blocks_mean for g in per_group))
    if b_adm > U:
        raise ConfigError(f"one prompt needs {b_adm} blocks but the pool has {U} usable (binding: length)")
    common = {"policy": policy, "blocks_admission": b_adm, "blocks_peak": b_max,
              "async_scheduling": cfg.async_scheduling, "shared_prefix_tokens": K, "groups": groups}
    if groups:
        if policy == "worst-case":
            raise ConfigError("the worst-case policy reserves full attention for every layer; a hybrid "
                              "model's groups are modelled by the vllm policies only", key="policy")
        common["binding_group"] = max(groups, key=lambda g: g["blocks_mean"])["group"]
    if policy == "worst-case":  # seed 000: reserve ceil((P+O)/B) blocks per request up front
        per = cdiv(P + O, B)
        limit = min(S, U // per)
        return Prediction(limit=limit, no_preemption_limit=limit, binding=_cap(limit, S, "max_num_seqs"),
                          usage_at_limit=min(1.0, limit * b_avg / U), method="closed-form",
                          how="closed form: usable // ceil((P+O)/B)", **{**common, "blocks_admission": per})
    # held once, by whoever runs (hybrid: not estimated; the simulation below shares what vLLM shares)
    sb = 0 if groups else vllm_shared_blocks(cfg, K)
    U_own, b_max_own, b_avg_own = U - sb, b_max - sb, b_avg - sb
    no_preempt = min(S, U_own // b_max_own)
    budget_limit = T * O / (P - sb * B + O)  # decodes + the prefill they need per step fill the budget
    if S * b_max_own <= U_own and S <= budget_limit:  # seq-limited: KV never binds
        return Prediction(limit=S, no_preemption_limit=S, binding="max_num_seqs",
                          usage_at_limit=(sb + S * b_avg_own) / U, method="closed-form",
                          how="closed form: max_num_seqs x peak blocks fit the pool", **common)
    estimate = min(U_own / b_avg_own, budget_limit, S)
    probe = min(S, max(math.ceil(1.3 * estimate), no_preempt) + 8)
    stats = closed_loop(_with_policy(cfg, policy), P, O, probe, shared_prefix_tokens=K, start="ramp",
                        ramp_width=_ramp_width(estimate))
    limit = round(stats.running_mean, 2)
    candidates = {"kv": 0.975 * U_own / b_avg_own, "max_num_seqs": S, "token_budget": budget_limit}
    binding = min(candidates, key=candidates.get)
    if binding == "max_num_seqs" and stats.waiting_mean > 0 and stats.preemptions_per_1k_steps > 0:
        binding = "kv"
    if groups:  # the groups peak at different moments: the closed loop itself, beside the bound
        common["clean_in_closed_loop"] = no_preemption_limit(
            _with_policy(cfg, policy), P, O, guess=math.floor(limit), ramp_width=_ramp_width(estimate),
            shared_prefix_tokens=K)
        common["clean_in_closed_loop_how"] = (f"largest N whose simulated closed loop (users ramped, width "
                                              f"{_ramp_width(estimate)}) never waits or preempts")
    return Prediction(limit=limit, no_preemption_limit=no_preempt, binding=binding,
                      usage_at_limit=round(stats.usage_mean, 3), method="schedsim", limit_mean=limit,
                      how=describe(stats, "ramp"), running_sem=round(stats.running_sem, 3), start="ramp",
                      probe_users=probe, ramp_width=_ramp_width(estimate), **common)


def _cap(limit: int, cap: int, name: str) -> str:
    return name if limit >= cap else "kv"


# --------------------------------------------------------------------------- SGLang


def sglang_published_usage(running: int, P: int, O: int, M: int, decode_log_interval: int = 40,  # noqa: E741
                           shared: int = 0) -> float:
    """The time average of sglang:token_usage as published with `running` requests admitted.

    The gauge is written only at prefill batches and every `decode_log_interval` decode steps
    (observability/metrics_reporter.py L719–899, L901–1140, 0.5.23) and holds its value between.
    In a closed loop, per request lifetime of O steps there are `running` prefill reports — each
    taken just after a request finished, whose tokens are evictable and so count as free, before
    its replacement is allocated: running − 1 requests held — and O / interval decode reports
    with all of them held. A held request averages its prompt and half its output; `shared`
    prompt tokens (a cached prefix) are held once for all. (The peak physical usage,
    running × (P + O − 1) / M, is what the dashboard never shows.)"""
    held = P - shared + (O - 1) / 2
    prefill_reports, decode_reports = running, O / decode_log_interval
    mean_requests = (prefill_reports * max(running - 1, 0) + decode_reports * running) / (prefill_reports + decode_reports)
    return round((mean_requests * held + (shared if running else 0)) / M, 2)


def sglang_shared_tokens(cfg: SglangConfig, K: int) -> int:
    """Prompt tokens every request finds in the radix tree: the shared prefix in whole pages."""
    return 0 if cfg.disable_radix_cache else K // cfg.page_size * cfg.page_size


def _sglang(cfg: SglangConfig, P: int, O: int, K: int, policy: str, layers=()) -> Prediction:  # noqa: E741
    M, ps, mrr = cfg.max_total_num_tokens, cfg.page_size, cfg.max_running_requests
    hybrid = is_hybrid_swa(cfg)
    if P + O > cfg.context_len - 2 or P + O > M - 2:  # max_new clipped silently (sglang.md §1.5)
        raise ConfigError(f"P+O = {P + O} must be <= context_len-2 ({cfg.context_len - 2}) and "
                          f"<= max_total_num_tokens-2 ({M - 2}) to generate exactly O tokens (binding: length)")
    o_clip = min(O, CLIP_MAX_NEW_TOKENS)
    need = P + o_clip + ps  # candidate's charge (check_prefill, strict <)
    peak = P + O - 1
    common = {"policy": policy, "blocks_admission": need, "blocks_peak": peak, "shared_prefix_tokens": K}
    if hybrid:  # the full and window pools' tokens of one request (sched_sglang_swa.request_pool_tokens)
        if policy == "worst-case":
            raise ConfigError("the worst-case policy reserves full attention for every layer; a hybrid "
                              "model's pools are modelled by the sglang policies only", key="policy")
        common["groups"] = tuple(request_pool_tokens(cfg, P, O, tuple(layers) or (0, 0)))
    if policy == "worst-case":
        per = cdiv(P + O, ps) * ps
        limit = min(mrr, M // per)
        return Prediction(limit=limit, no_preemption_limit=limit,
                          binding=_cap(limit, mrr, "max_running_requests"),
                          usage_at_limit=round(limit * peak / M, 2), method="closed-form",
                          how="closed form: pool // (P+O)", **common)
    shared = sglang_shared_tokens(cfg, K)  # locked in the tree once, matched by every candidate
    u = (P + O if cfg.overlap else P + O - 1) - shared  # per running request at admission time (§3.1)
    need_own = need - shared
    room = M - shared
    reserved = min(mrr, max(0, (room - need_own - 1) // u + 1)) if need_own < room else 0
    if reserved == 0:
        raise ConfigError(f"one request needs {need} tokens reserved but the pool holds {M} (binding: length)")
    # The steady state depends on the arrival history: users that join one at a time run at
    # spread phases (one admission per finish), users that start together run in cohorts whose
    # simultaneous finishes refill in one pass (several prompts, a chunked one, a prefill step
    # that pauses everyone's decode). The limit is the larger steady state: the engine sustains it.
    runs = {}
    probe = min(mrr, max(reserved + 2, 2 * reserved) + 2)
    for start in ("ramp", "burst"):
        runs[start] = closed_loop(_with_policy(cfg, policy), P, O, probe, shared_prefix_tokens=K, start=start,
                                  ramp_width=_ramp_width(reserved))
    for run in runs.values():
        _check_modelled(run)
    start = max(runs, key=lambda k: (runs[k].running_max, runs[k].running_mean))
    stats = runs[start]
    # (hybrid SWA: the window pool frees as requests grow and nothing walks the futures: no bound)
    reservation = policy == "sglang-0.5.22" and stats.preemptions_per_1k_steps == 0 and not hybrid
    # a reservation policy admits up to its bound and never retracts: the limit is that bound;
    # a drifting one (0.5.21's ratio, O > 4096 clipped) oscillates: its limit is the mean
    limit = stats.running_max if reservation else round(stats.running_mean, 2)
    binding = "max_running_requests" if limit >= mrr - 0.5 else "kv"
    if hybrid and binding == "kv":  # the pool that refused most admissions in the measured window
        common["binding_group"] = window_pool_label(cfg.sliding_window_size) if stats.window_blocked > 0.5 \
            else FULL_POOL
    usage = sglang_published_usage(stats.running_max, P, O, M, shared=shared) if reservation \
        else round(stats.usage_mean, 2)
    if hybrid:  # sglang:token_usage is the larger pool's usage at each sample: the larger mean, about
        usage = round(max(stats.usage_mean, stats.swa_usage_mean), 2)
    other = runs["burst" if start == "ramp" else "ramp"]
    how = describe(stats, start) + (f"; the {'burst' if start == 'ramp' else 'ramp'} start settles at "
                                    f"{other.running_max} (mean {other.running_mean:.2f})"
                                    if other.running_max != stats.running_max else "")
    no_preempt = min(reserved, stats.running_max if reservation else reserved)
    if hybrid:  # the full pool's bound says nothing of the window pool: the fewest that ran saturated
        no_preempt = min(reserved, stats.running_min)
    return Prediction(limit=limit, no_preemption_limit=no_preempt,
                      binding=binding, usage_at_limit=usage, method="schedsim",
                      limit_mean=round(stats.running_mean, 2), how=how, running_sem=round(stats.running_sem, 3),
                      start=start, probe_users=probe, ramp_width=_ramp_width(reserved), **common)
