"""Admission limit of a fixed-length workload (P prompt, O output tokens, ignore_eos) per policy.

Closed forms where the engine's rule makes them exact (reservation engines), the step simulation
(`schedsim.closed_loop`) where the answer is a dynamic plateau (vLLM's preemption cycle, SGLang's
new_token_ratio drift). Formulas: shared/reference/vllm.md §3, shared/reference/sglang.md §3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvprobe.errors import ConfigError
from kvprobe.theory.schedsim import CLIP_MAX_NEW_TOKENS, SglangConfig, VllmConfig, cdiv, closed_loop

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


def predict(config: VllmConfig | SglangConfig, prompt_tokens: int, output_tokens: int,
            users: int | None = None, *, policy: str | None = None) -> Prediction:
    P, O = prompt_tokens, output_tokens  # noqa: E741  (the references' names)
    if P < 1 or O < 1:
        raise ConfigError(f"prompt_tokens and output_tokens must be >= 1, got P={P} O={O}")
    policy = policy or config.policy
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    if isinstance(config, VllmConfig):
        pred = _vllm(config, P, O, policy)
    elif isinstance(config, SglangConfig):
        pred = _sglang(config, P, O, policy)
    else:
        raise ConfigError(f"expected VllmConfig or SglangConfig, got {type(config).__name__}")
    if users is None:
        return pred
    sim_config = _with_policy(config, policy)
    stats = closed_loop(sim_config, P, O, users)
    return Prediction(**{**pred.__dict__, "users": users, "running": stats.running_mean,
                         "waiting": stats.waiting_mean, "preemption_rate": stats.preemptions_per_1k_steps})


def _with_policy(config, policy: str):
    if policy == "worst-case" or policy == config.policy:
        return config
    fields = {**config.__dict__, "policy": policy}
    return type(config)(**fields)


# --------------------------------------------------------------------------- vLLM


def vllm_request_blocks(P: int, O: int, B: int) -> tuple[int, int, float]:  # noqa: E741
    """(b_adm, b_max, b_avg) of one request: admit ceil(P/B); the KV of output O is never written,
    so the peak is ceil((P+O-1)/B); b_avg is the time average over its O steps (vllm.md §2.6)."""
    b_adm, b_max = cdiv(P, B), cdiv(P + O - 1, B)
    b_avg = (b_adm + sum(cdiv(P + k, B) for k in range(1, O))) / O
    return b_adm, b_max, b_avg


def _vllm(cfg: VllmConfig, P: int, O: int, policy: str) -> Prediction:  # noqa: E741
    B, U, S, T = cfg.block_size, cfg.num_gpu_blocks - 1, cfg.max_num_seqs, cfg.max_num_batched_tokens
    if P + O > cfg.max_model_len:  # 0.33 clamps max_tokens, then min_tokens=O is a 400 (vllm.md §4)
        raise ConfigError(f"P+O = {P + O} exceeds max_model_len {cfg.max_model_len} (binding: length)")
    b_adm, b_max, b_avg = vllm_request_blocks(P, O, B)
    if b_adm > U:
        raise ConfigError(f"one prompt needs {b_adm} blocks but the pool has {U} usable (binding: length)")
    common = {"policy": policy, "blocks_admission": b_adm, "blocks_peak": b_max}
    if policy == "worst-case":  # seed 000: reserve ceil((P+O)/B) blocks per request up front
        per = cdiv(P + O, B)
        limit = min(S, U // per)
        return Prediction(limit=limit, no_preemption_limit=limit, binding=_cap(limit, S, "max_num_seqs"),
                          usage_at_limit=min(1.0, limit * b_avg / U), method="closed-form",
                          **{**common, "blocks_admission": per})
    no_preempt = min(S, U // b_max)
    budget_limit = T * O / (P + O)  # decodes + the prefill they need per step fill the budget
    if S * b_max <= U and S <= budget_limit:  # seq-limited: KV never binds
        return Prediction(limit=S, no_preemption_limit=S, binding="max_num_seqs",
                          usage_at_limit=S * b_avg / U, method="closed-form", **common)
    probe = min(S, max(math.ceil(1.3 * U / b_avg), no_preempt) + 8)
    if S > probe:
        probe = min(S, math.ceil(1.3 * min(U / b_avg, budget_limit)) + 8)
    stats = closed_loop(_with_policy(cfg, policy), P, O, probe)
    limit = round(stats.running_mean, 2)
    candidates = {"kv": 0.975 * U / b_avg, "max_num_seqs": S, "token_budget": budget_limit}
    binding = min(candidates, key=candidates.get)
    if binding == "max_num_seqs" and stats.waiting_mean > 0 and stats.preemptions_per_1k_steps > 0:
        binding = "kv"
    return Prediction(limit=limit, no_preemption_limit=no_preempt,
                      binding=binding, usage_at_limit=round(stats.usage_mean, 3), method="schedsim", **common)


def _cap(limit: int, cap: int, name: str) -> str:
    return name if limit >= cap else "kv"


# --------------------------------------------------------------------------- SGLang


def sglang_published_usage(running: int, P: int, O: int, M: int, decode_log_interval: int = 40) -> float:  # noqa: E741
    """The time average of sglang:token_usage as published with `running` requests admitted.

    The gauge is written only at prefill batches and every `decode_log_interval` decode steps
    (observability/metrics_reporter.py L719–899, L901–1140, 0.5.23) and holds its value between.
    In a closed loop, per request lifetime of O steps there are `running` prefill reports — each
    taken just after a request finished, whose tokens are evictable and so count as free, before
    its replacement is allocated: running − 1 requests held — and O / interval decode reports
    with all of them held. A held request averages its prompt and half its output. (The peak
    physical usage, running × (P + O − 1) / M, is what the dashboard never shows.)"""
    held = P + (O - 1) / 2
    prefill_reports, decode_reports = running, O / decode_log_interval
    mean_requests = (prefill_reports * max(running - 1, 0) + decode_reports * running) / (prefill_reports + decode_reports)
    return round(mean_requests * held / M, 2)


def _sglang(cfg: SglangConfig, P: int, O: int, policy: str) -> Prediction:  # noqa: E741
    M, ps, mrr = cfg.max_total_num_tokens, cfg.page_size, cfg.max_running_requests
    if P + O > cfg.context_len - 2 or P + O > M - 2:  # max_new clipped silently (sglang.md §1.5)
        raise ConfigError(f"P+O = {P + O} must be <= context_len-2 ({cfg.context_len - 2}) and "
                          f"<= max_total_num_tokens-2 ({M - 2}) to generate exactly O tokens (binding: length)")
    o_clip = min(O, CLIP_MAX_NEW_TOKENS)
    need = P + o_clip + ps  # candidate's charge (check_prefill, strict <)
    peak = P + O - 1
    common = {"policy": policy, "blocks_admission": need, "blocks_peak": peak}
    if policy == "worst-case":
        per = cdiv(P + O, ps) * ps
        limit = min(mrr, M // per)
        return Prediction(limit=limit, no_preemption_limit=limit,
                          binding=_cap(limit, mrr, "max_running_requests"),
                          usage_at_limit=round(limit * peak / M, 2), method="closed-form", **common)
    u = P + O if cfg.overlap else P + O - 1  # per running request at admission time (§3.1)
    reserved = min(mrr, max(0, (M - need - 1) // u + 1)) if need < M else 0
    if reserved == 0:
        raise ConfigError(f"one request needs {need} tokens reserved but the pool holds {M} (binding: length)")
    binding = _cap(reserved, mrr, "max_running_requests")
    exact = (policy == "sglang-0.5.22" and O <= CLIP_MAX_NEW_TOKENS and ps == 1
             and not cfg.disable_radix_cache and P <= max(cfg.chunked_prefill_size, 1))
    if exact:
        return Prediction(limit=reserved, no_preemption_limit=reserved, binding=binding,
                          usage_at_limit=sglang_published_usage(reserved, P, O, M), method="closed-form", **common)
    # drift (0.5.21 ratio), clipped reservations (O > 4096), pages, --disable-radix-cache: simulate,
    # staggered (completions spread out is where the drift shows) and long enough for the ratio decay
    probe = min(mrr, 2 * max(reserved, M // max(P + O // 2, 1)) + 4)
    steps = max(3000, 6 * O)
    stats = closed_loop(_with_policy(cfg, policy), P, O, probe, steps=steps, warmup=steps // 3, stagger=True)
    limit = round(stats.running_mean, 2)
    binding = "max_running_requests" if limit >= mrr - 0.5 else "kv"
    return Prediction(limit=limit, no_preemption_limit=reserved, binding=binding,
                      usage_at_limit=round(stats.usage_mean, 2), method="schedsim", **common)
