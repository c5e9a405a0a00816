"""SGLang's admission limit of a fixed-length workload: the step simulation of its reservation
(python/sglang/srt/managers/schedule_policy.py `PrefillAdder`, scheduler.py), from the arrival
history whose steady state is larger; the worst case in closed form."""

from __future__ import annotations

from kvprobe.errors import ConfigError
from kvprobe.theory.model.sizes import cdiv
from kvprobe.theory.prediction import (
    Prediction,
    cap_binding,
    check_modelled,
    describe,
    ramp_width,
    with_policy,
)
from kvprobe.theory.schedsim import SglangConfig, closed_loop, request_lifetime
from kvprobe.theory.sglang.reports import sglang_published_usage
from kvprobe.theory.sglang.schedule_policy import CLIP_MAX_NEW_TOKENS
from kvprobe.theory.sglang.swa.request import FULL_POOL, request_pool_tokens, window_pool_label
from kvprobe.theory.sglang.swa.scheduler import is_hybrid_swa


def sglang_shared_tokens(cfg: SglangConfig, K: int) -> int:
    """Prompt tokens every request finds in the radix tree: the shared prefix in whole pages."""
    return 0 if cfg.disable_radix_cache else K // cfg.page_size * cfg.page_size


def spread_ramp_width(cfg: SglangConfig, P: int, O: int, estimate: float) -> int:  # noqa: E741
    """The ramp start's width (users per lifetime) at which users still join at distinct phases.

    SGLang runs a prefill batch whenever one can be built and decodes only when none can
    (scheduler.py get_next_batch_to_run: "Run prefill first if possible", 0.5.19 L3446-3455; 0.5.23
    L3992-4001). Users arriving less than one prompt's prefill passes plus one step apart are
    therefore all prefilled before anyone decodes: they finish together and refill together, one
    cohort, as if they had started at once (P=1760 over 2,048-token chunks, 25 users a step apart:
    18.1 running on 41,242 tokens, the burst's 18.3; two steps apart: 22.4). The ramp is meant to
    spread phases (`prediction.ramp_width`), so it is narrowed until consecutive users are at
    least that far apart."""
    life = request_lifetime(cfg, P, O)
    passes = life - (O - 1)  # the prompt's prefill passes (request_lifetime)
    return max(1, min(ramp_width(estimate), life // (passes + 1)))


def predict_sglang(cfg: SglangConfig, P: int, O: int, K: int, policy: str, layers=()) -> Prediction:  # noqa: E741
    M, ps, mrr = cfg.max_total_num_tokens, cfg.page_size, cfg.max_running_requests
    hybrid = is_hybrid_swa(cfg)
    if P + O > cfg.context_len - 2 or P + O > M - 2:  # max_new clipped silently (scheduler.py init_req_max_new_tokens)
        raise ConfigError(f"P+O = {P + O} must be <= context_len-2 ({cfg.context_len - 2}) and "
                          f"<= max_total_num_tokens-2 ({M - 2}) to generate exactly O tokens (binding: length)")
    o_clip = min(O, CLIP_MAX_NEW_TOKENS)
    need = P + o_clip + ps  # candidate's charge (check_prefill, strict <)
    peak = P + O - 1
    common = {"policy": policy, "blocks_admission": need, "blocks_peak": peak, "shared_prefix_tokens": K}
    if hybrid:  # the full and window pools' tokens of one request (sglang/swa/request.request_pool_tokens)
        if policy == "worst-case":
            raise ConfigError("the worst-case policy reserves full attention for every layer; a hybrid "
                              "model's pools are modelled by the sglang policies only", key="policy")
        common["groups"] = tuple(request_pool_tokens(cfg, P, O, tuple(layers) or (0, 0)))
    if policy == "worst-case":
        per = cdiv(P + O, ps) * ps
        limit = min(mrr, M // per)
        return Prediction(limit=limit, no_preemption_limit=limit,
                          binding=cap_binding(limit, mrr, "max_running_requests"),
                          usage_at_limit=round(limit * peak / M, 2), method="closed-form",
                          how="closed form: pool // (P+O)", **common)
    shared = sglang_shared_tokens(cfg, K)  # locked in the tree once, matched by every candidate
    u = (P + O if cfg.overlap else P + O - 1) - shared  # per running request at admission time (PrefillAdder)
    need_own = need - shared
    room = M - shared
    reserved = min(mrr, max(0, (room - need_own - 1) // u + 1)) if need_own < room else 0
    if reserved == 0:
        raise ConfigError(f"one request needs {need} tokens reserved but the pool holds {M} (binding: length)")
    # The steady state depends on the arrival history: users that join one at a time run at
    # spread phases (one admission per finish), users that start together run in cohorts whose
    # simultaneous finishes refill in one pass (several prompts, a chunked one, a prefill step
    # that pauses everyone's decode). The limit is the larger steady state: the engine sustains it.
    # A probe's levels add users in groups: its plateau lies between the two (docs/diff.md,
    # "SGLang's memory rules").
    runs = {}
    probe = min(mrr, max(reserved + 2, 2 * reserved) + 2)
    width = spread_ramp_width(cfg, P, O, reserved)
    for start in ("ramp", "burst"):
        runs[start] = closed_loop(with_policy(cfg, policy), P, O, probe, shared_prefix_tokens=K, start=start,
                                  ramp_width=width)
    for run in runs.values():
        check_modelled(run)
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
    usage = sglang_published_usage(stats.running_max, P, O, M, shared=shared, overlap=cfg.overlap) if reservation \
        else round(stats.usage_mean, 2)
    if hybrid:  # sglang:token_usage is the larger pool's usage at each sample: the larger mean, about
        usage = round(max(stats.usage_mean, stats.swa_usage_mean), 2)
    other = runs["burst" if start == "ramp" else "ramp"]
    how = describe(stats, start) + (f"; the {'burst' if start == 'ramp' else 'ramp'} start settles at "
                                    f"{other.running_max} (mean {other.running_mean:.2f})"
                                    if other.running_max != stats.running_max
                                    or abs(other.running_mean - stats.running_mean) > 0.5 else "")
    no_preempt = min(reserved, stats.running_max if reservation else reserved)
    if hybrid:  # the full pool's bound says nothing of the window pool: the fewest that ran saturated
        no_preempt = min(reserved, stats.running_min)
    return Prediction(limit=limit, no_preemption_limit=no_preempt,
                      binding=binding, usage_at_limit=usage, method="schedsim",
                      limit_mean=round(stats.running_mean, 2), how=how, running_sem=round(stats.running_sem, 3),
                      start=start, probe_users=probe, ramp_width=width, **common)
