"""One probe, from an Expectation to a ProbeResult: predict, reach the engine, ramp, observe, judge.

A probe is one `ProbeRun` (kvprobe.probe.state: expectation, prediction, target, load, sampler,
windows, records) moved through named steps — begin, reach_engine, start_client, time_a_request,
start_load, run_ramp, stop_load, watch_drain, analyse, judge, close — each taking what it needs
from it; the console, the pytest plugin and the tests all enter through `run_probe(exp, options)
-> ProbeResult`. Whatever happens (a failed check, a dead engine, Ctrl-C, SIGTERM), `run_probe`
stops Locust, the sampler and the engine it started, and writes what it has. From the request
timed alone to the load's stop (its client started idle before) a probe holds the machine's load
turn when it shares one (kvprobe.load.turns; a quiet probe also the machine to itself, and the
machine shared from its launch to its close). The target is whatever kind the expectation names,
through one interface (kvprobe.targets.interface); the steps do not ask which. The result and
options live in `probe.result`, the calibration in `probe.calibrate`, the load steps in
`probe.load_steps` and `probe.ramp`, the analysis and the checks in `probe.judge`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path

from kvprobe.engines import get_dialect
from kvprobe.errors import ConfigError, KvprobeError, TargetError
from kvprobe.load.turns import load_turn, machine_share, share_priority
from kvprobe.probe import repro
from kvprobe.probe.calibrate import CALIBRATION_REQUESTS, calibrate, hold_seconds, planned_levels
from kvprobe.probe.judge import analyse, judge
from kvprobe.probe.load_steps import start_client, start_load, stop_load, watch_drain
from kvprobe.probe.ramp import run_ramp
from kvprobe.probe.result import ERROR, FAILED, PASSED, SCHEMA_VERSION, ProbeOptions, ProbeResult
from kvprobe.probe.state import ProbeRun
from kvprobe.targets import open as targets
from kvprobe.targets.interface import OpenHow
from kvprobe.theory.ledger.text import render_ledger

__all__ = ["ERROR", "FAILED", "PASSED", "SCHEMA_VERSION", "ProbeOptions", "ProbeResult", "ProbeRun", "analyse",
           "drive", "judge", "run_probe", "predict", "open_target"]


def predict(exp, users: int | None = None):
    """The ledger for an expectation (raises ConfigError on impossible settings): one engine's, as
    the target the expectation names turns it into its own (a fleet's: R replicas behind a router)."""
    from kvprobe.spec.expectation import ledger_inputs
    from kvprobe.theory.ledger.build import build_ledger

    ledger = build_ledger(ledger_inputs(exp, users=users))
    if ledger.admission is None and (ledger.not_predicted or "").startswith("not modelled "):
        # a release change kvprobe has no model for: nothing to judge the engine against
        raise ConfigError(f"expected a release and flags kvprobe models: {ledger.not_predicted}", key="version")
    return targets.target_kind(exp).ledger(exp, ledger)


def open_target(exp, options: ProbeOptions, artifacts: Path):
    """Launch the emulator, the engine, a shadow engine or a fleet in its own process group(s), or
    attach to a URL."""
    command = tuple(options.engine_command) if options.engine_command else None
    return targets.open_target(exp, OpenHow(artifacts=artifacts, url=options.url, engine_command=command))


def begin(exp, options: ProbeOptions) -> ProbeRun:
    """Overrides applied, the artifacts folder made, the ledger predicted and written."""
    exp = apply_overrides(exp, options)
    artifacts = Path(options.artifacts_dir)
    artifacts.mkdir(parents=True, exist_ok=True)
    result = ProbeResult(expectation=exp)
    ledger = predict(exp)
    result.ledger = ledger.to_dict()
    (artifacts / "ledger.txt").write_text(render_ledger(ledger) + "\n")
    return ProbeRun(exp=exp, options=options, artifacts=artifacts, result=result, ledger=ledger,
                    dialect=get_dialect(exp.engine), deadline=time.monotonic() + exp.profile.budget_seconds)


def reach_engine(pr: ProbeRun) -> None:
    """Launch or attach, read what the engine reports, check it against the expectation."""
    pr.log(f"kvprobe: {pr.exp.name}: predicted admission limit {pr.prediction.limit:g} "
           f"({pr.prediction.binding} binds)")
    pr.target = open_target(pr.exp, pr.options, pr.artifacts)
    pr.result.facts = pr.target.facts()
    discover_engine(pr)


def time_a_request(pr: ProbeRun) -> None:
    """Time a request alone (the unit of a hold in request lifetimes) and set each level's hold."""
    lifetimes = pr.exp.profile.hold.lifetimes
    lifetime, times = calibrate(pr.target, pr.exp, pr.model, requests=CALIBRATION_REQUESTS if lifetimes else 1)
    pr.lifetime = lifetime
    levels = planned_levels(pr.exp, pr.prediction.limit) if lifetimes else None
    pr.hold, capped = hold_seconds(pr.exp, lifetime, levels=levels, remaining=pr.deadline - time.monotonic())
    alone = f"median of {', '.join(f'{t:.2f}' for t in times)}s" if len(times) > 1 else "alone"
    pr.log(f"kvprobe: engine up at {pr.target.url}; one request takes {lifetime:.2f}s ({alone}); "
           f"hold {pr.hold:.1f}s per level")
    if capped:
        pr.log(f"kvprobe: {capped}")


def discover_engine(pr: ProbeRun) -> None:
    """What the engine publishes about its configuration becomes the ledger's (the expectation fills
    only the rest); assumptions and contradictions are said before the ramp starts."""
    from kvprobe.observe.discovery import discover

    disc = discover(pr.exp, pr.result.facts)
    pr.result.discovery = disc.to_dict()
    exp = disc.expectation(pr.exp)
    if (exp.flags, exp.version) != (pr.exp.flags, pr.exp.version):
        before = pr.prediction
        try:
            ledger = predict(exp)
        except KvprobeError as err:  # e.g. a published chunk size whose reserve leaves the declared GPU no KV
            pr.log(f"kvprobe: {exp.name}: the engine's published configuration gives no ledger ({err}); "
                   "the prediction stays the expectation's")
            ledger, exp = pr.ledger, replace(pr.exp, served_model_name=exp.served_model_name)
        pr.ledger = ledger
        pr.result.ledger = pr.ledger.to_dict()
        (pr.artifacts / "ledger.txt").write_text(render_ledger(pr.ledger) + "\n")
        if (before.limit, before.binding) != (pr.prediction.limit, pr.prediction.binding):
            pr.log(f"kvprobe: {exp.name}: from what the engine publishes: admission limit {pr.prediction.limit:g} "
                   f"({pr.prediction.binding} binds); the expectation alone gave {before.limit:g} ({before.binding})")
    pr.exp = exp
    for line in disc.lines(pr.ledger):
        pr.log(f"kvprobe: {line}")


def record_error(pr: ProbeRun, err: KvprobeError) -> None:
    first, _, rest = str(err).partition("\n")
    result = pr.result
    result.error = first
    # The reason is one line; what the engine or Locust said last is kept beside it.
    result.log_tail = (getattr(err, "log_tail", "") or rest).strip() or None
    if isinstance(err, TargetError) and pr.target is not None:
        result.error += f" (engine log: {pr.artifacts / 'engine.log'})"
    pr.log(f"kvprobe: {pr.exp.name}: {result.error}")


def close(pr: ProbeRun) -> None:
    """Stop whatever is still running and write what there is (also after a failure or Ctrl-C)."""
    from kvprobe.report import console as report

    # Order matters: stop the load before the engine so no request sees a dying server.
    if pr.load is not None:
        pr.load.stop()
        if not pr.records:
            pr.records = _safe(pr.load.records, [])
    if pr.sampler is not None:
        pr.series = pr.sampler.stop()
        pr.replica_series = getattr(pr.sampler, "replica_series", None)
    if pr.target is not None:
        pr.target.close()
    pr.result.finished = time.time()
    repro.after_probe(pr)
    pr.result.artifacts = report.write_artifacts(pr.result, pr.artifacts, series=pr.series, records=pr.records,
                                                 windows=pr.windows)


def run_probe(exp, options: ProbeOptions) -> ProbeResult:
    """Run one probe end to end. Never raises for a failed check; raises KvprobeError for bad input."""
    pr = begin(exp, options)
    with contextlib.ExitStack() as machine:  # a quiet probe's share of the machine, to its engine's stop
        try:
            machine.enter_context(machine_share())
            drive(pr)
        except ConfigError as err:  # bad input (a refused API key, the other engine): written, then the caller's
            record_error(pr, err)
            raise
        except KvprobeError as err:
            record_error(pr, err)
        finally:
            close(pr)
    return pr.result


def drive(pr, *, adjust=None) -> None:
    """A begun probe's steps, from reaching its engine to its verdict; `adjust(pr)` runs once the
    engine is reached and the ledger read (a benchmark scales the prediction there)."""
    reach_engine(pr)
    if adjust is not None:
        adjust(pr)
    start_client(pr)  # idle until the turn: its start is not the turn's (close() stops it on failure)
    with load_turn(log=pr.log) as waited:
        pr.deadline += waited  # the budget counts the probe's own time, not another's turn
        share_priority(pr.load.pgid)  # the client takes the turn's boost (kvprobe.load.turns)
        try:
            time_a_request(pr)
            start_load(pr)
            run_ramp(pr)
            stop_load(pr)
        except BaseException:
            if pr.load is not None:
                pr.load.stop()  # before the turn passes on: no other probe ramps beside this load
            raise
    watch_drain(pr)
    analyse(pr)
    judge(pr)


def _safe(fn, default):
    try:
        return fn()
    except Exception:  # noqa: BLE001 — partial artifacts must never mask the original failure
        return default


def apply_overrides(exp, options: ProbeOptions):
    """Tolerance, budget and profile overrides from the command line or pytest options."""
    from kvprobe.spec.expectation import override_profile

    if options.profile:
        exp = override_profile(exp, options.profile)  # re-checks P+O against the engine's limits
    changes = {}
    if options.tolerances:
        changes["tolerances"] = replace(exp.tolerances, **options.tolerances)
    if options.budget_seconds:
        changes["profile"] = replace(exp.profile, budget_seconds=options.budget_seconds)
    return replace(exp, **changes) if changes else exp
