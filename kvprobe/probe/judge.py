"""The last two steps of a probe: `analyse` turns the series and records into levels, the
rejection point, the diagnosis and the drain; `judge` runs every selected check against the
prediction. Both read and fill a `kvprobe.probe.state.ProbeRun`; the target adds its own figures
and checks (a fleet's per-replica ones) through its interface."""

from __future__ import annotations

from dataclasses import replace

from kvprobe.analysis import client, plateau
from kvprobe.analysis import levels as analysis
from kvprobe.errors import KvprobeError
from kvprobe.load.prompts import as_prompt_format
from kvprobe.probe.state import ProbeRun
from kvprobe.verdict import checks as verdict
from kvprobe.verdict.fleet import scale


def analyse(pr: ProbeRun) -> None:
    """Per-level figures with every record flushed, reconciled with the engine's gauge; the
    rejection point; the limit the measurement shows; the drain."""
    from kvprobe.analysis.diagnosis import diagnose

    result, dialect, exp = pr.result, pr.dialect, pr.exp
    arrays = pr.series.arrays()
    metrics_ok = bool(arrays["ok"].any()) if len(arrays["ok"]) else False
    levels = analysis.level_stats(arrays, pr.windows, warmup_fraction=exp.profile.hold.warmup, records=pr.records,
                                  lead_steps=dialect.FIRST_TOKEN_LEAD_STEPS,
                                  counter_lazy=dialect.PREEMPTION_COUNTER_LAZY)
    result.levels = analysis.reconcile(levels, gauge_exact=dialect.RUNNING_GAUGE_EXACT, metrics_ok=metrics_ok)
    result.rejection = plateau.find_rejection_point(result.levels)
    client.mark_levels(result.levels, pr.records, warmup_fraction=exp.profile.hold.warmup)
    # a level on the plateau a starved client served, or a starved run, leaves the load's checks unjudged
    pr.starvation = client.starvation(result.levels, result.client, judged=set(result.rejection.saturated_levels))
    pool_units = _pool_units(result.ledger)
    pr.target.analyse(pr, pool_units)  # a fleet's per-replica figures; an uneven split sets the plateau's prediction
    pool_units = pool_units and pool_units * pr.target.pools  # the summed series' pool
    tol = exp.tolerances
    limit = float(pr.prediction.limit)
    result.diagnosis = diagnose(
        prediction=pr.prediction, rejection=result.rejection, levels=result.levels,
        allowance=max(tol.rejection_point, tol.rejection_point_relative * limit), usage_tol=tol.usage_gap,
        client=pr.starvation, reported=result.facts.reported, config=pr.ledger.scheduler_config, dialect=dialect,
        prompt_tokens=exp.profile.request.prompt_tokens, output_tokens=exp.profile.request.output_tokens,
        reported_agrees=_reported_agrees(pr))
    idle = dialect.IDLE_REPORT_SECONDS
    window = analysis.drain_window(exp.profile.drain_seconds, idle)
    result.drain = analysis.drain_check(arrays, pr.t_stop, deadline_s=window, pool_units=pool_units,
                                        idle_report_seconds=idle)


def _reported_agrees(pr: ProbeRun) -> bool | None:
    reported = verdict.check_reported_capacity(pr.result.ledger, pr.result.facts.reported,
                                               pr.exp.tolerances.reported_capacity)
    return None if reported.inconclusive else reported.passed


def judge(pr: ProbeRun) -> None:
    """Every selected check (and the expected failure) against the prediction; those that read the
    load are left unjudged when the load generator was the bottleneck (`analyse` found it)."""
    result, exp, prediction = pr.result, pr.exp, pr.prediction
    tol = exp.tolerances
    shape = exp.profile.request
    unit = "blocks" if exp.engine == "vllm" else "tokens"
    reported = verdict.check_reported_capacity(result.ledger, result.facts.reported, tol.reported_capacity)
    agrees = None if reported.inconclusive else reported.passed
    # the reported pool, times the pools the series sums (a fleet's R replicas)
    implied = scale(engine_implied(pr.ledger.scheduler_config, exp, result.facts.reported), pr.target.pools)
    judged = {"reported_agrees": agrees, "implied": implied, "diagnosis": result.diagnosis}
    weights = result.rejection.weights if result.rejection is not None else {}
    disagreeing = [lv for lv in result.levels if lv.disagrees and weights.get(lv.users, 0) > 0]
    checks = {
        "reported_capacity": lambda: reported,
        "rejection_point": lambda: verdict.check_rejection_point(prediction, result.rejection, tol,
                                                                 disagreeing=disagreeing, **judged),
        "no_preemption": lambda: verdict.check_no_preemption(
            prediction, result.rejection, tol, unpredicted=_unpredicted_preemptions(pr) if pr.target.one_engine else [],
            **judged),
        "leak": lambda: verdict.check_leak(result.drain, _pool_units(result.ledger), unit),
        "usage_gap": lambda: verdict.check_usage_gap(prediction, result.rejection, tol.usage_gap, **judged),
        "exactness": lambda: verdict.check_exactness(pr.records, shape.prompt_tokens, shape.output_tokens),
        "length_limit": lambda: _length_limit(pr),
    }
    checks.update(pr.target.checks(pr, _pool_units(result.ledger), unit))
    wanted = list(exp.checks)
    if exp.expect_fail and exp.expect_fail not in wanted:
        wanted.append(exp.expect_fail)
    # a starved load generator leaves every check that reads the load unjudged, with one reason
    result.checks = [verdict.unjudged_if_starved(checks[name](), pr.starvation) for name in wanted]


# Preemptions a level must show before they count against a policy that predicts none: one or two
# can come from the moment a level's users arrive together, before the steady state.
MIN_UNPREDICTED_PREEMPTIONS = 3


def _unpredicted_preemptions(pr: ProbeRun) -> list[tuple[int, float]]:
    """(N, preemptions) at the levels that preempted although the ledger's simulated steady state at
    that N preempts nothing (asked only when the series is one engine's: one replica's ledger says
    nothing about a fleet's summed counter)."""
    from kvprobe.theory.ledger.build import build_ledger

    out = []
    for lv in pr.result.levels:
        if lv.too_few_samples or lv.preemptions is None or lv.preemptions < MIN_UNPREDICTED_PREEMPTIONS:
            continue
        try:
            at_n = build_ledger(replace(pr.ledger.inputs, users=lv.users)).admission
        except KvprobeError:  # the ledger refuses these settings: nothing is predicted, nothing to hold against
            continue
        if at_n.preemption_rate == 0:
            out.append((lv.users, lv.preemptions))
    return out


def engine_implied(config, exp, reported):
    """The admission prediction for the pool the engine *reports* (same policy and limits): it
    separates "our theory is wrong" from "the engine sized its pool differently"."""
    from kvprobe.theory.admission import predict as predict_admission

    pool = {"vllm": ("num_gpu_blocks", reported.num_blocks), "sglang": ("max_total_num_tokens", reported.kv_tokens)}
    field_name, value = pool.get(exp.engine, (None, None))
    if config is None or value is None:
        return None
    shape = exp.profile.request
    try:
        return predict_admission(replace(config, **{field_name: int(value)}), shape.prompt_tokens, shape.output_tokens,
                                 shared_prefix_tokens=shape.shared_prefix_tokens)
    except KvprobeError:
        return None


def _pool_units(ledger: dict | None) -> int | None:
    if not ledger:
        return None
    cap = ledger["capacity"]
    return cap.get("num_blocks") or cap.get("kv_tokens")


def _length_limit(pr: ProbeRun):
    """Send P+O one token past the engine's length limit and expect the engine's refusal."""
    from kvprobe.observe.oneshot import post_completion, unique_prompt

    dialect, target = pr.dialect, pr.target
    limit = dialect.length_limit(pr.result.facts.reported)
    if limit is None:
        return verdict.check_length_limit(None, 400, "")
    max_len, expected_status = limit
    out = pr.exp.profile.request.output_tokens
    prompt = max(1, max_len - out + 1)
    body = dialect.completion_body(unique_prompt(prompt, 1), out, model=pr.model, stream=False)
    body = as_prompt_format(body, target.prompt_format)
    shot = post_completion(target.url, body, path=dialect.COMPLETIONS_PATH, headers=target.headers, timeout=30)
    return verdict.check_length_limit(shot, expected_status, f"P+O = {prompt}+{out} > {max_len}")
