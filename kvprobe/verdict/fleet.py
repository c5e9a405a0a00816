"""Per-replica figures of a fleet probe and the fleet's own checks.

The probe's usual analysis runs on the fleet's summed series (its rejection point is the
fleet's, judged against R x L by the usual rejection_point check). Here each replica's series is
read over the same level windows: running, waiting, usage and in-flight per replica, the
imbalance (max - min in flight) the router left, and the policy's prediction at that N.

- replica_leak: every replica drains to zero after the load stops (a fleet-wide usage mean hides
  one block leaked on one of three replicas: 1/(3*pool) is under the half-block tolerance).
- replica_usage: at the deepest level, every replica with someone waiting in most samples reads,
  while someone waits, the usage gauge one replica's ledger predicts at its limit.
- router_imbalance: at every level, the measured imbalance matches the policy's prediction.
"""

from __future__ import annotations

import dataclasses
import math

from kvprobe.analysis import levels as analysis
from kvprobe.theory import fleet as theory
from kvprobe.verdict.checks import CheckResult, check, fmt, stale_gauges

QUEUED = 0.5  # predicted fleet waiting from which an uneven split is judged at a level
FULL_FRACTION = 0.5  # a replica with someone waiting in this share of a level's samples sat at its limit then


def _f(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def usage_when_waiting(series_arrays: dict, windows, warmup_fraction: float) -> list[tuple[float | None, float]]:
    """Per window: the mean usage gauge over the samples with someone waiting at this replica (what
    one replica's ledger predicts at its limit: schedsim's usage_at_full), and the fraction of
    samples with someone waiting. A replica behind a random router is full part of a level only."""
    import numpy as np

    t, usage, waiting = series_arrays["t"], series_arrays["usage"], series_arrays["waiting"]
    out = []
    for w in windows:
        t0 = w.t_start + warmup_fraction * (w.t_end - w.t_start)
        sel = (t >= t0) & (t <= w.t_end) & np.isfinite(waiting)
        full = sel & (waiting >= 1) & np.isfinite(usage)
        n = int(sel.sum())
        out.append((float(usage[full].mean()) if full.any() else None, float(full.sum()) / n if n else 0.0))
    return out


def replica_levels(replica_series, windows, *, warmup_fraction: float, counter_lazy: bool) -> list[list]:
    """level_stats of each replica over the probe's windows: [replica][level]."""
    return [analysis.level_stats(s.arrays(), windows, warmup_fraction=warmup_fraction, counter_lazy=counter_lazy)
            for s in replica_series]


SEEDS = 5  # a random policy's prediction at N: the mean of this many seeded simulations
LIFETIMES = 30  # ... each this many request lifetimes long, unless the measured window is given
MIN_LIFETIMES = 4


def predict_level(ledger, users: int, *, prompt_tokens: int, output_tokens: int,
                  window_lifetimes: float | None = None) -> dict | None:
    """The policy's prediction at N users: exact for an even split, else the mean of SEEDS runs as
    long as the measured window (`window_lifetimes`), whose spread (`fleet_running_sd`) is what one
    level's mean can show: a random split mixes slowly, a few seconds' mean wanders."""
    config = ledger.scheduler_config
    if config is None:
        return None
    kw = dict(limit=ledger.replica_limit)
    if ledger.even and users % ledger.replicas == 0:
        return theory.predict(config, prompt_tokens, output_tokens, users, ledger.replicas, ledger.policy,
                              **kw).to_dict()
    lifetimes = max(MIN_LIFETIMES, window_lifetimes) if window_lifetimes else LIFETIMES
    seeds = 1 if ledger.even else SEEDS  # an even split is deterministic: one run says it all
    runs = [theory.simulate(config, prompt_tokens, output_tokens, users, ledger.replicas, ledger.policy, seed=k,
                            lifetimes=lifetimes, **kw) for k in range(seeds)]
    out = runs[0].to_dict()
    for key in ("fleet_running", "fleet_waiting", "imbalance", "fleet_usage"):
        out[key] = sum(r.to_dict()[key] for r in runs) / len(runs)
    running = [r.fleet_running for r in runs]
    mean = sum(running) / len(running)
    out["fleet_running_sd"] = (sum((x - mean) ** 2 for x in running) / (len(running) - 1)) ** 0.5 if seeds > 1 else 0.0
    out["seeds"], out["lifetimes"] = len(runs), lifetimes
    return out


def fleet_figures(ledger, per_replica: list[list], *, prompt_tokens: int, output_tokens: int,
                  window_lifetimes: float | None = None, full_usage: list[list] | None = None) -> dict:
    """Per level: each replica's means, the imbalance, and the policy's prediction at that N."""
    levels = []
    for j in range(len(per_replica[0]) if per_replica else 0):
        rows = [lv[j] for lv in per_replica]
        users = rows[0].users
        inflight = [(_f(r.running_mean) or 0.0) + (_f(r.waiting_mean) or 0.0) for r in rows]
        levels.append({
            "users": users,
            "replicas": [{"running": _f(r.running_mean), "waiting": _f(r.waiting_mean), "usage": _f(r.usage_mean),
                          "inflight": x, "samples": r.samples,
                          "usage_when_waiting": full_usage[i][j][0] if full_usage else None,
                          "waiting_fraction": full_usage[i][j][1] if full_usage else None}
                         for i, (r, x) in enumerate(zip(rows, inflight, strict=True))],
            "running": sum(_f(r.running_mean) or 0.0 for r in rows),
            "imbalance": max(inflight) - min(inflight),
            "predicted": predict_level(ledger, users, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                                       window_lifetimes=window_lifetimes),
        })
    return {"replicas": ledger.replicas, "policy": ledger.policy, "even_split": ledger.even,
            "replica_limit": ledger.replica_limit, "fleet_limit": float(ledger.admission.limit), "levels": levels}


def plateau_prediction(figures: dict, weights: dict[int, float], key: str = "fleet_running") -> float | None:
    """A figure the policy predicts (fleet running, fleet usage), weighted as the measured plateau
    weights its levels."""
    pairs = [(weights.get(lv["users"], 0.0), lv["predicted"][key]) for lv in figures.get("levels", [])
             if lv["predicted"] is not None and lv["predicted"].get(key) is not None]
    total = sum(w for w, _ in pairs)
    return sum(w * x for w, x in pairs) / total if total > 0 else None


@check("replica_leak", reads_load=False)
def check_replica_leak(drains: list, pool_units: int | None, unit: str) -> CheckResult:
    res = CheckResult("replica_leak", predicted=0, tolerance="0 on every replica")
    if not drains or any(d is None or not d.samples for d in drains):
        res.inconclusive = True
        res.reason = "a replica had no /metrics samples after the load stopped"
        return res
    res.measured = [_f(d.residual_usage) for d in drains]
    bad = [i for i, d in enumerate(drains) if not d.drained]
    res.passed = not bad
    stale = [i for i in bad if drains[i].stale]
    if stale:
        res.inconclusive = True
        res.reason = (", ".join(f"replica {i}" for i in stale) + " still read usage after the load stopped, but "
                      + stale_gauges(drains[stale[0]]))
    elif res.passed:
        res.reason = f"every replica drained to zero (slowest {max(d.time_to_zero for d in drains):.1f}s)"
    else:
        parts = []
        for i in bad:
            d = drains[i]
            leaked = d.leaked_blocks_estimate
            parts.append(f"replica {i}: usage {fmt(d.residual_usage)}, running {fmt(d.residual_running)}"
                         + (f", ≈{leaked} {unit} leaked" if leaked else ""))
        res.reason = "; ".join(parts) + " after the load stopped"
    return res


@check("replica_usage", reads_load=True)
def check_replica_usage(figures: dict, usage_at_limit: float, tol: float) -> CheckResult:
    """At the deepest level, each replica that had someone waiting most of the time: its usage gauge
    while someone waited, against one replica's ledger at its limit."""
    res = CheckResult("replica_usage", predicted=round(usage_at_limit, 3), tolerance=f"±{tol:g}")
    levels = figures.get("levels") or []
    if not levels:
        res.inconclusive = True
        res.reason = "no level was measured"
        return res
    deepest = levels[-1]
    reps = deepest["replicas"]
    res.measured = [None if r["usage_when_waiting"] is None else round(r["usage_when_waiting"], 3) for r in reps]
    full = [(i, r["usage_when_waiting"]) for i, r in enumerate(reps)
            if (r["waiting_fraction"] or 0) >= FULL_FRACTION and r["usage_when_waiting"] is not None]
    if not full:
        res.inconclusive = True
        res.reason = f"no replica had someone waiting most of the deepest level ({deepest['users']} users)"
        return res
    off = [i for i, u in full if abs(u - usage_at_limit) > tol + 1e-9]
    res.passed = not off
    res.reason = (f"{len(full)} replica(s) with a queue at {deepest['users']} users read "
                  + ", ".join(f"{u:.0%}" for _, u in full) + f" while it waited; one replica's ledger predicts "
                  f"{usage_at_limit:.0%}")
    if off:
        res.reason += " — off: " + ", ".join(f"replica {i}" for i in off)
    return res


def imbalance_allowance(users: int, tol, spread: float = 0.0) -> float:
    """The rejection point's tolerance at N, or twice the spread one window of a random split shows."""
    return max(tol.rejection_point, tol.rejection_point_relative * users, 2 * spread)


@check("router_imbalance", reads_load=True)
def check_router_imbalance(figures: dict, tol, *, gauge_exact: bool = True) -> CheckResult:
    """An even split: the measured max - min in flight per replica against the prediction (about 0:
    a sharp test of the router). A random split fluctuates too slowly for a few seconds' mean of
    max - min to be judged; there the fleet's running (what the imbalance costs) is compared."""
    even = figures.get("even_split", True)
    what = "imbalance (max - min in flight per replica)" if even else "fleet running"
    res = CheckResult("router_imbalance", tolerance="per level: max(rejection_point, rejection_point_relative x N"
                      + (")" if even else ", 2 x the simulated spread of one level's window)"))
    if not gauge_exact:
        res.inconclusive = True
        res.reason = ("this engine's running and queue gauges are samples (the dialect's RUNNING_GAUGE_EXACT), "
                      "so each replica's share of the requests in flight cannot be read from them")
        return res
    levels = [lv for lv in figures.get("levels") or [] if lv["predicted"] is not None
              and all(r["samples"] for r in lv["replicas"])
              # uneven: where the split makes requests wait; below, running trails N by the client's
              # round trip through the router, which the simulation (zero client latency) leaves out
              and (even or lv["predicted"]["fleet_waiting"] >= QUEUED)]
    if not levels:
        res.inconclusive = True
        res.reason = ("no level with samples from every replica and a prediction" if even else
                      "no level where the policy's split is predicted to make requests wait")
        return res

    def pair(lv):
        return (lv["imbalance"], lv["predicted"]["imbalance"]) if even else (lv["running"],
                                                                           lv["predicted"]["fleet_running"])

    res.measured = [round(pair(lv)[0], 2) for lv in levels]
    res.predicted = [round(pair(lv)[1], 2) for lv in levels]
    off = [lv for lv in levels if abs(pair(lv)[0] - pair(lv)[1])
           > imbalance_allowance(lv["users"], tol, lv["predicted"].get("fleet_running_sd", 0.0))]
    res.passed = not off
    res.reason = (f"{figures.get('policy')}: {what}, measured vs predicted at "
                  + ", ".join(f"{lv['users']} users ({pair(lv)[0]:.1f} vs {pair(lv)[1]:.1f})" for lv in levels))
    if off:
        res.reason += " — outside the allowance at " + ", ".join(str(lv["users"]) for lv in off) + " users"
    return res


# --- a fleet probe's own figures and checks (kvprobe.targets.fleet.target.FleetTarget hands them to the probe)


def scale(prediction, replicas: int):
    """One replica's Prediction as the fleet's (limits x R), e.g. the engine-implied one."""
    if prediction is None or replicas == 1:
        return prediction
    mean = None if prediction.limit_mean is None else replicas * prediction.limit_mean
    return dataclasses.replace(prediction, limit=replicas * prediction.limit, limit_mean=mean,
                               no_preemption_limit=replicas * prediction.no_preemption_limit)


def analyse_replicas(pr, pool_units: int | None) -> None:
    """Per-replica level figures and drains of a probe run (`kvprobe.probe.run.ProbeRun`; the fleet's
    own were read from the summed series). A policy that splits unevenly sets the plateau's
    prediction."""
    exp = pr.exp
    series = pr.replica_series or []
    per_replica = replica_levels(series, pr.windows, warmup_fraction=exp.profile.hold.warmup,
                                 counter_lazy=pr.dialect.PREEMPTION_COUNTER_LAZY)
    shape = exp.profile.request
    steady = pr.hold * (1 - exp.profile.hold.warmup)
    window = steady / pr.lifetime if pr.lifetime else None  # request lifetimes in one level's steady window
    full_usage = [usage_when_waiting(s.arrays(), pr.windows, exp.profile.hold.warmup) for s in series]
    figures = fleet_figures(pr.ledger, per_replica, prompt_tokens=shape.prompt_tokens,
                            output_tokens=shape.output_tokens, window_lifetimes=window, full_usage=full_usage)
    idle = pr.dialect.IDLE_REPORT_SECONDS
    window = analysis.drain_window(exp.profile.drain_seconds, idle)
    figures["drains"] = [analysis.drain_check(s.arrays(), pr.t_stop, deadline_s=window, pool_units=pool_units,
                                              idle_report_seconds=idle) for s in series] if pr.t_stop else []
    pr.result.fleet = figures
    rejection = pr.result.rejection
    if not pr.ledger.even and rejection is not None and rejection.weights:
        # A policy that splits unevenly: the fleet reaches R x L only once every replica is full; at
        # the levels the plateau is measured on, it runs what the simulated router leaves.
        plateau = plateau_prediction(figures, rejection.weights)
        usage = plateau_prediction(figures, rejection.weights, "fleet_usage")
        if plateau is not None:
            a = pr.ledger.admission
            pr.ledger.admission = dataclasses.replace(
                a, limit=plateau, usage_at_limit=a.usage_at_limit if usage is None else usage,
                how=f"{pr.ledger.policy} split simulated at the plateau's levels "
                    f"({', '.join(map(str, rejection.weights))} users); R x L = {float(a.limit):g}")
            pr.result.ledger = pr.ledger.to_dict()
            pr.log(f"kvprobe: {pr.ledger.policy} routing: the fleet's plateau at the measured levels is predicted "
                   f"at {plateau:.2f} (R x L = {float(a.limit):g} once every replica is full)")
    for lv in figures["levels"]:
        share = "  ".join(f"r{i} {r['running'] or 0:.1f}+{r['waiting'] or 0:.1f}" for i, r in enumerate(lv["replicas"]))
        pred = lv["predicted"]
        pr.log(f"  users {lv['users']:>4}: per replica running+waiting {share}; imbalance {lv['imbalance']:.1f}"
               + (f" (predicted {pred['imbalance']:.1f}, {pred['binding']} binds)" if pred else ""))


def probe_checks(pr, pool_units: int | None, unit: str) -> dict:
    """The fleet's checks by name, each run on demand against the figures `analyse_replicas` left."""
    figures = pr.result.fleet or {}
    tol = pr.exp.tolerances
    usage = float(pr.ledger.replica.admission.usage_at_limit)
    return {
        "replica_leak": lambda: check_replica_leak(figures.get("drains") or [], pool_units, unit),
        "replica_usage": lambda: check_replica_usage(figures, usage, tol.usage_gap),
        "router_imbalance": lambda: check_router_imbalance(figures, tol, gauge_exact=pr.dialect.RUNNING_GAUGE_EXACT),
    }
