"""The probe's steps for a fleet target (kvprobe/probe/run.py calls these where `exp.target.fleet`).

Launch or attach the fleet, sample every replica, read per-replica figures after the ramp, and
add the fleet's checks. The rest of the probe runs unchanged on the fleet's summed series.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvprobe.verdict import fleet as fchecks


def is_fleet(exp) -> bool:
    return bool(getattr(exp.target, "fleet", None))


def replicas(exp) -> int:
    return int(exp.target.fleet["replicas"])


def ledger(exp, replica_ledger):
    from kvprobe.theory.ledger.fleet import fleet_ledger

    shape = exp.profile.request
    return fleet_ledger(replica_ledger, replicas=replicas(exp), policy=exp.target.fleet["policy"],
                        prompt_tokens=shape.prompt_tokens, output_tokens=shape.output_tokens)


def scale(prediction, exp):
    """One replica's Prediction as the fleet's (limits x R), e.g. the engine-implied one."""
    if prediction is None:
        return None
    R = replicas(exp)
    return dataclasses.replace(prediction, limit=R * prediction.limit,
                               no_preemption_limit=R * prediction.no_preemption_limit)


def open_fleet(exp, options, artifacts: Path, dialect):
    """Launch R emulated replicas and the router, or attach to a running fleet."""
    from kvprobe.probe.run import emulator_args
    from kvprobe.procgroup import free_port
    from kvprobe.targets.fleet.target import FleetTarget
    from kvprobe.targets.launch import Target

    fleet = exp.target.fleet
    if exp.target.mode == "url":
        return FleetTarget.attach(exp.target.url, fleet["replica_urls"], engine=exp.engine, policy=fleet["policy"],
                                  api_key_env=exp.target.api_key_env)
    served = exp.served_model_name if exp.served_model_name not in (None, exp.model) else None
    flags = {**exp.flags, "served-model-name": served} if served else exp.flags

    def launch_replica(i: int, log_path: Path) -> Target:
        port = free_port()
        argv = dialect.emulator_command(exp.model, flags, host="127.0.0.1", port=port,
                                        extra=emulator_args(exp.target.emulator), version=exp.version)
        return Target.launch(argv, engine=exp.engine, port=port, log_path=str(log_path),
                             startup_timeout=exp.target.startup_timeout, env=exp.target.env or None)

    return FleetTarget.launch(engine=exp.engine, replicas=fleet["replicas"], policy=fleet["policy"],
                              artifacts=artifacts, launch_replica=launch_replica)


def sampler(pr):
    from kvprobe.targets.fleet.sampler import FleetSampler

    return FleetSampler(pr.target.replica_urls, pr.dialect.METRICS, interval=pr.exp.profile.sample_interval,
                        headers=pr.target.headers)


def analyse(pr, pool_units: int | None) -> None:
    """Per-replica level figures and drains (the fleet's own were read from the summed series)."""
    from kvprobe.analysis import levels as analysis

    exp = pr.exp
    series = pr.replica_series or []
    per_replica = fchecks.replica_levels(series, pr.windows, warmup_fraction=exp.profile.hold.warmup,
                                         counter_lazy=pr.dialect.PREEMPTION_COUNTER_LAZY)
    shape = exp.profile.request
    steady = pr.hold * (1 - exp.profile.hold.warmup)
    window = steady / pr.lifetime if pr.lifetime else None  # request lifetimes in one level's steady window
    full_usage = [fchecks.usage_when_waiting(s.arrays(), pr.windows, exp.profile.hold.warmup) for s in series]
    figures = fchecks.fleet_figures(pr.ledger, per_replica, prompt_tokens=shape.prompt_tokens,
                                    output_tokens=shape.output_tokens, window_lifetimes=window, full_usage=full_usage)
    figures["drains"] = [analysis.drain_check(s.arrays(), pr.t_stop, deadline_s=exp.profile.drain_seconds,
                                              pool_units=pool_units) for s in series] if pr.t_stop else []
    pr.result.fleet = figures
    rejection = pr.result.rejection
    if not pr.ledger.even and rejection is not None and rejection.weights:
        # A policy that splits unevenly: the fleet reaches R x L only once every replica is full; at
        # the levels the plateau is measured on, it runs what the simulated router leaves.
        plateau = fchecks.plateau_prediction(figures, rejection.weights)
        usage = fchecks.plateau_prediction(figures, rejection.weights, "fleet_usage")
        if plateau is not None:
            a = pr.ledger.admission
            pr.ledger.admission = dataclasses.replace(
                a, limit=plateau, usage_at_limit=a.usage_at_limit if usage is None else usage, how=f"{pr.ledger.policy} split simulated at the plateau's levels "
                                      f"({', '.join(map(str, rejection.weights))} users); R x L = {float(a.limit):g}")
            pr.result.ledger = pr.ledger.to_dict()
            pr.log(f"kvprobe: {pr.ledger.policy} routing: the fleet's plateau at the measured levels is predicted "
                   f"at {plateau:.2f} (R x L = {float(a.limit):g} once every replica is full)")
    for lv in figures["levels"]:
        share = "  ".join(f"r{i} {r['running'] or 0:.1f}+{r['waiting'] or 0:.1f}" for i, r in enumerate(lv["replicas"]))
        pred = lv["predicted"]
        pr.log(f"  users {lv['users']:>4}: per replica running+waiting {share}; imbalance {lv['imbalance']:.1f}"
               + (f" (predicted {pred['imbalance']:.1f}, {pred['binding']} binds)" if pred else ""))


def checks(pr, pool_units: int | None, unit: str) -> dict:
    figures = pr.result.fleet or {}
    tol = pr.exp.tolerances
    usage = float(pr.ledger.replica.admission.usage_at_limit)
    return {
        "replica_leak": lambda: fchecks.check_replica_leak(figures.get("drains") or [], pool_units, unit),
        "replica_usage": lambda: fchecks.check_replica_usage(figures, usage, tol.usage_gap),
        "router_imbalance": lambda: fchecks.check_router_imbalance(figures, tol,
                                                                   gauge_exact=pr.dialect.RUNNING_GAUGE_EXACT),
    }


def as_target_prompt(body: dict, target) -> dict:
    """A request body as the target takes it: behind sglang-router, the prompt as text."""
    if getattr(target, "prompt_format", "ids") == "text" and isinstance(body.get("prompt"), list):
        from kvprobe.load.prompts import ids_to_text

        return {**body, "prompt": ids_to_text(body["prompt"])}
    return body
