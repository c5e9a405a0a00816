"""vLLM's admission limit of a fixed-length workload: closed forms where the reservation makes them
exact (seq-limited, worst case), the step simulation where the limit is the plateau of the
preemption cycle (vllm/v1/core/sched/scheduler.py `schedule`, vllm/v1/core/kv_cache_manager.py
`allocate_slots`)."""

from __future__ import annotations

import dataclasses
import math

from kvprobe.errors import ConfigError
from kvprobe.theory.model.sizes import cdiv
from kvprobe.theory.prediction import Prediction, cap_binding, describe, ramp_width, with_policy
from kvprobe.theory.schedsim import VllmConfig, closed_loop
from kvprobe.theory.vllm.hybrid.groups import no_preemption_limit, request_group_blocks
from kvprobe.theory.vllm.hybrid.scheduler import is_hybrid


def vllm_request_blocks(P: int, O: int, B: int) -> tuple[int, int, float]:  # noqa: E741
    """(b_adm, b_max, b_avg) of one request: admit ceil(P/B); output O is sampled but never run
    through the model, so its KV is never written and the peak is ceil((P+O-1)/B); b_avg is the
    time average over its O steps."""
    b_adm, b_max = cdiv(P, B), cdiv(P + O - 1, B)
    b_avg = (b_adm + sum(cdiv(P + k, B) for k in range(1, O))) / O
    return b_adm, b_max, b_avg


def vllm_shared_blocks(cfg: VllmConfig, K: int) -> int:
    """Blocks every request shares under prefix caching: the full blocks of the shared prefix
    (only full blocks are hashed, kv_cache_utils.py; the hit is capped at P - 1 tokens, K < P)."""
    return K // cfg.block_size if cfg.enable_prefix_caching else 0


def predict_vllm(cfg: VllmConfig, P: int, O: int, K: int, policy: str, layers=()) -> Prediction:  # noqa: E741
    B, U, S, T = cfg.block_size, cfg.num_gpu_blocks - 1, cfg.max_num_seqs, cfg.max_num_batched_tokens
    if P + O > cfg.max_model_len:  # 0.33 clamps max_tokens, then min_tokens=O is a 400 (api_utils.py get_max_tokens)
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
        return Prediction(limit=limit, no_preemption_limit=limit, binding=cap_binding(limit, S, "max_num_seqs"),
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
    stats = closed_loop(with_policy(cfg, policy), P, O, probe, shared_prefix_tokens=K, start="ramp",
                        ramp_width=ramp_width(estimate))
    limit = round(stats.running_mean, 2)
    candidates = {"kv": 0.975 * U_own / b_avg_own, "max_num_seqs": S, "token_budget": budget_limit}
    binding = min(candidates, key=candidates.get)
    if binding == "max_num_seqs" and stats.waiting_mean > 0 and stats.preemptions_per_1k_steps > 0:
        binding = "kv"
    if groups:  # the groups peak at different moments: the closed loop itself, beside the bound
        common["clean_in_closed_loop"] = no_preemption_limit(
            with_policy(cfg, policy), P, O, guess=math.floor(limit), ramp_width=ramp_width(estimate),
            shared_prefix_tokens=K)
        common["clean_in_closed_loop_how"] = (f"largest N whose simulated closed loop (users ramped, width "
                                              f"{ramp_width(estimate)}) never waits or preempts")
    return Prediction(limit=limit, no_preemption_limit=no_preempt, binding=binding,
                      usage_at_limit=round(stats.usage_mean, 3), method="schedsim", limit_mean=limit,
                      how=describe(stats, "ramp"), running_sem=round(stats.running_sem, 3), start="ramp",
                      probe_users=probe, ramp_width=ramp_width(estimate), **common)
