"""Admission limit of a fixed-length workload (P prompt, O output tokens, ignore_eos) per policy.

Closed forms where the engine's rule makes them exact (reservation engines), the step simulation
(`schedsim.closed_loop`) where the answer is a dynamic plateau (vLLM's preemption cycle, SGLang's
new_token_ratio drift). This module names the policies and dispatches: the engines' models are
`kvprobe.theory.vllm.admission` and `kvprobe.theory.sglang.admission`, the record they return
`kvprobe.theory.prediction.Prediction`.
"""

from __future__ import annotations

from dataclasses import replace

from kvprobe.errors import ConfigError
from kvprobe.theory.prediction import (
    NotModelled,
    Prediction,
    check_modelled,
    describe,
    ramp_width,
    with_policy,
)
from kvprobe.theory.schedsim import SglangConfig, VllmConfig, closed_loop
from kvprobe.theory.sglang import releases as sglang_releases
from kvprobe.theory.sglang.admission import predict_sglang, spread_ramp_width
from kvprobe.theory.vllm import releases as vllm_releases
from kvprobe.theory.vllm.admission import predict_vllm

__all__ = ["POLICIES", "NotModelled", "Prediction", "policy_for", "policy_rule", "predict"]

POLICIES = ("vllm-0.33", "vllm-0.11", "sglang-0.5.22", "sglang-0.5.21", "worst-case")


def policy_for(engine: str, version: str, *, reserve_full_isl: bool = True) -> str:
    """The admission policy of an engine version (reserve_full_isl: vLLM's
    --scheduler-reserve-full-isl): the engine's release rules decide."""
    if engine == "vllm":
        return vllm_releases.policy(version, reserve_full_isl=reserve_full_isl)
    if engine == "sglang":
        return sglang_releases.policy(version)
    raise ConfigError(f"unknown engine {engine!r}; expected vllm or sglang")


def policy_rule(policy: str) -> str:
    """What a policy's rule says, from its engine's release rules (a diff between releases names it)."""
    rules = {**vllm_releases.RULES, **sglang_releases.RULES,
             "worst-case": "every request reserved at its peak (a bound, no release's rule)"}
    return rules.get(policy, f"the rule of policy {policy}")


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
        pred = predict_vllm(config, P, O, K, policy, layers)
    elif isinstance(config, SglangConfig):
        pred = predict_sglang(config, P, O, K, policy, layers)
    else:
        raise ConfigError(f"expected VllmConfig or SglangConfig, got {type(config).__name__}")
    if users is None:
        return pred
    start, width = _users_start(pred, config, P, O)
    stats = closed_loop(with_policy(config, policy), P, O, users, shared_prefix_tokens=K, start=start,
                        ramp_width=min(users, width))
    check_modelled(stats)
    return replace(pred, users=users, running=round(stats.running_mean, 2), waiting=round(stats.waiting_mean, 2),
                   preemption_rate=round(stats.preemptions_per_1k_steps, 2), running_sem=round(stats.running_sem, 3),
                   waiting_sem=round(stats.waiting_sem, 3), users_how=describe(stats, start))


def _users_start(pred: Prediction, config, P: int, O: int) -> tuple[str, int]:  # noqa: E741
    """The steady state at N users is simulated from the start that reaches the limit (SGLang's
    ramp narrowed as its limit's was: sglang/admission.spread_ramp_width)."""
    width = ramp_width(pred.limit)
    if isinstance(config, SglangConfig):
        width = spread_ramp_width(config, P, O, pred.limit)
    return pred.start or "ramp", width
