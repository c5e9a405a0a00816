"""One probe, from an Expectation to a ProbeResult: predict, reach the engine, ramp, observe, judge.

A probe is one `ProbeRun` (expectation, prediction, target, load, sampler, windows, records)
moved through named steps — begin, reach_engine, start_load, run_ramp, stop_load, analyse, judge,
close — each taking what it needs from it; the console, the pytest plugin and the tests all enter
through `run_probe(exp, options) -> ProbeResult`. Whatever happens (a failed check, a dead engine, Ctrl-C, SIGTERM),
`run_probe` stops Locust, the sampler and the engine it started, and writes what it has. The result
and options live in `probe_result`, the analysis and the checks in `probe_judge`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvprobe.analysis import levels as analysis
from kvprobe.analysis import plateau
from kvprobe.engines import get_dialect
from kvprobe.errors import KvprobeError, ProbeError, TargetError
from kvprobe.probe.judge import analyse, judge
from kvprobe.probe.result import ERROR, FAILED, PASSED, SCHEMA_VERSION, ProbeOptions, ProbeResult
from kvprobe.theory.ledger.text import render_ledger

__all__ = ["ERROR", "FAILED", "PASSED", "SCHEMA_VERSION", "ProbeOptions", "ProbeResult", "analyse", "judge",
           "run_probe", "predict", "open_target", "emulator_args", "calibrate"]


# --- the steps --------------------------------------------------------------------------------


def predict(exp, users: int | None = None):
    """The ledger for an expectation (raises ConfigError on impossible settings)."""
    from kvprobe.probe import fleet
    from kvprobe.spec.expectation import ledger_inputs
    from kvprobe.theory.ledger.build import build_ledger

    ledger = build_ledger(ledger_inputs(exp, users=users))
    return fleet.ledger(exp, ledger) if fleet.is_fleet(exp) else ledger  # one replica's ledger, and the fleet's


def open_target(exp, options: ProbeOptions, artifacts: Path, dialect=None):
    """Launch the emulator or the engine in its own process group, or attach to a URL."""
    from kvprobe.targets.launch import Target, free_port

    dialect = dialect or get_dialect(exp.engine)
    if exp.target.fleet:
        from kvprobe.probe.fleet import open_fleet

        return open_fleet(exp, options, artifacts, dialect)
    url = options.url or exp.target.url
    if url:
        return Target.attach(url, engine=exp.engine, api_key_env=exp.target.api_key_env)
    port = exp.target.port or free_port()
    if exp.target.mode == "shadow":
        from kvprobe.targets.shadow.target import open_shadow

        return open_shadow(exp, port=port, log_path=artifacts / "engine.log")
    # The engine loads `model` (or `target.model`) and serves it as `served_model_name`: the name the
    # load sends.
    served = exp.served_model_name if exp.served_model_name not in (None, exp.model) else None
    if exp.target.mode == "emulator":
        flags = {**exp.flags, "served-model-name": served} if served else exp.flags
        argv = dialect.emulator_command(exp.model, flags, host="127.0.0.1", port=port,
                                        extra=emulator_args(exp.target.emulator), version=exp.version)
    else:
        from kvprobe.spec.expectation import launched_model, served_name

        # A command replaces the engine's binary ("vllm serve", "python -m sglang.launch_server");
        # the model and flags follow as the dialect writes them.
        binary = list(options.engine_command or exp.target.command or ()) or None
        argv = dialect.launch_command(launched_model(exp), exp.flags, host="127.0.0.1", port=port, binary=binary,
                                      served_model_name=served_name(exp))
    return Target.launch(argv, engine=exp.engine, port=port, log_path=str(artifacts / "engine.log"),
                         startup_timeout=exp.target.startup_timeout, env=exp.target.env or None)


def emulator_args(options: dict) -> list[str]:
    """The emulator's own time-model and fault flags from `target.emulator` in the YAML."""
    args: list[str] = []
    for key, value in sorted((options or {}).items()):
        if key == "faults":
            for fault in value:
                args += ["--fault", str(fault)]
        elif key == "args":
            args += [str(a) for a in value]
        elif value is True:
            args.append(f"--{key.replace('_', '-')}")
        elif value not in (False, None):
            args += [f"--{key.replace('_', '-')}", str(value)]
    return args


# Requests timed alone before a hold given in lifetimes: the median of a few survives one slow
# request on a loaded machine (issue 13: one 37.6 s calibration made every level 94 s long).
CALIBRATION_REQUESTS = 3
# Two that agree this closely settle it: a third adds nothing but one more lifetime (12 s each
# for SGLang's long-output shapes here).
CALIBRATION_AGREE = 0.05


def calibrate(target, exp, model: str | None, *, requests: int = 1) -> tuple[float, list[float]]:
    """Seconds one request takes alone: the median of `requests` sequential requests (the unit of a
    hold given in request lifetimes), and every time measured."""
    from statistics import median

    from kvprobe.observe.oneshot import post_completion, unique_prompt
    from kvprobe.probe.fleet import as_target_prompt

    dialect = target.dialect
    shape = exp.profile.request
    times = []
    for i in range(requests):
        body = dialect.completion_body(unique_prompt(shape.prompt_tokens, i), shape.output_tokens, model=model,
                                       stream=True)
        body = as_target_prompt(body, target)
        shot = post_completion(target.url, body, path=dialect.COMPLETIONS_PATH, headers=target.headers, timeout=120)
        if not shot.ok:
            raise ProbeError(f"calibration request failed: HTTP {shot.status} {shot.body[:300]}")
        if (shot.prompt_tokens, shot.completion_tokens) != (shape.prompt_tokens, shape.output_tokens):
            raise ProbeError(
                f"calibration usage {shot.prompt_tokens}/{shot.completion_tokens} != requested "
                f"{shape.prompt_tokens}/{shape.output_tokens}: the engine does not honour fixed lengths"
            )
        times.append(shot.seconds)
        if len(times) == 2 and abs(times[0] - times[1]) <= CALIBRATION_AGREE * max(times):
            break
    return median(times), times


def planned_levels(exp, predicted: float | None) -> int:
    """How many levels the profile's ramp will run: its plan, or a bisection's usual length."""

    from kvprobe.load.ramps import BisectRamp, make_ramp

    ramp = make_ramp(exp.profile.ramp, predicted)
    if isinstance(ramp, BisectRamp):
        return math.ceil(math.log2(ramp.hi - ramp.lo + 2)) + 2 * ramp.confirm
    return max(1, len(ramp.planned()))


def hold_seconds(exp, lifetime: float | None, *, levels: int | None = None,
                 remaining: float | None = None) -> tuple[float, str | None]:
    """Seconds per level, and a message when the time budget capped it. A hold in lifetimes is
    capped so that `levels` levels and the drain fit the `remaining` seconds of the budget."""
    hold = exp.profile.hold
    if not hold.lifetimes:
        return float(hold.seconds), None
    wanted = max(hold.lifetimes * (lifetime or 1.0), 2.0)
    if levels is None or remaining is None:
        return wanted, None
    cap = (remaining - exp.profile.drain_seconds) / max(1, levels)
    if wanted <= cap:
        return wanted, None
    capped = max(cap, 2.0)
    note = (f"hold capped at {capped:.1f}s per level by the time budget ({levels} levels in {remaining:.0f}s left "
            f"of budget_seconds {exp.profile.budget_seconds:g}); {hold.lifetimes:g} lifetimes would be {wanted:.1f}s")
    if lifetime and capped < lifetime:
        note += f"; shorter than one request ({lifetime:.2f}s): raise budget_seconds for a steady state"
    return capped, note


def level_result(stats):
    from kvprobe.load.ramps import LevelResult

    # Every engine queues a request for up to one step after it arrives, and a closed-loop user
    # spends part of its cycle between requests, so "waiting > 0" or "running < N" alone is not
    # saturation; a queue of a tenth of the users, or running far below N, is.
    saturated = stats.waiting_mean >= max(1.0, 0.1 * stats.users) or stats.running_mean < 0.8 * stats.users
    return LevelResult(users=stats.users, running=stats.running_mean, waiting=stats.waiting_mean,
                       preemption_rate=stats.preemption_rate_per_s, saturated=saturated)


# --- one probe run: its state, and the steps that move it ------------------------------------


@dataclass
class ProbeRun:
    """Everything one probe holds while it runs. `run_probe` moves it through named steps
    (reach the engine, start the load, ramp, stop the load, analyse, judge, close); each step
    reads what it needs from here and leaves what it produced."""

    exp: object  # the Expectation, overrides applied
    options: ProbeOptions
    artifacts: Path
    result: ProbeResult
    ledger: object  # theory.ledger.Ledger
    dialect: object  # the engine's dialect module, resolved once
    deadline: float  # time.monotonic() by which the ramp must end
    target: object = None  # engines.launcher.Target
    load: object = None  # load.runner.LocustRun
    sampler: object = None  # observe.Sampler
    hold: float = 0.0  # seconds per level
    lifetime: float | None = None  # seconds one request takes alone (calibration)
    windows: list = field(default_factory=list)  # analysis.LevelWindow per level run
    series: object = None  # observe.TimeSeries once the sampler stopped
    records: list = field(default_factory=list)  # load.records.Record, once Locust stopped
    replica_series: list | None = None  # a fleet: each replica's observe.TimeSeries, once the sampler stopped
    t_stop: float | None = None  # when the load stopped (the drain is watched from here)

    @property
    def prediction(self):
        return self.ledger.admission

    @property
    def model(self) -> str:
        return self.exp.served_model_name or self.exp.model

    def log(self, line: str) -> None:
        self.options.log(line)


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
    """Launch or attach, read what the engine reports, check it against the expectation, time a
    request alone."""
    pr.log(f"kvprobe: {pr.exp.name}: predicted admission limit {pr.prediction.limit:g} "
           f"({pr.prediction.binding} binds)")
    pr.target = open_target(pr.exp, pr.options, pr.artifacts, pr.dialect)
    pr.result.facts = pr.target.facts()
    discover_engine(pr)
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


def start_load(pr: ProbeRun) -> None:
    """The /metrics sampler, then Locust at zero users."""
    from kvprobe.load.runner import LocustRun
    from kvprobe.observe.sampler import Sampler

    exp, shape = pr.exp, pr.exp.profile.request
    if exp.target.fleet:
        from kvprobe.probe.fleet import sampler

        pr.sampler = sampler(pr)  # every replica's /metrics; `series` is the fleet's sum
    else:
        pr.sampler = Sampler(pr.target.url, pr.dialect.METRICS, interval=exp.profile.sample_interval,
                             headers=pr.target.headers)
    pr.sampler.start()
    workers = exp.profile.workers
    remote = ({"expect_workers": workers.expect, "bind_host": workers.host, "bind_port": workers.port,
               "workers_wait": workers.wait_seconds} if workers else {})
    pr.load = LocustRun(pr.target.url, model=pr.model, prompt_tokens=shape.prompt_tokens,
                        output_tokens=shape.output_tokens, workdir=pr.artifacts / "locust",
                        api_key_env=exp.target.api_key_env, processes=exp.profile.processes, stream=shape.stream,
                        engine=exp.engine, shared_prefix_tokens=shape.shared_prefix_tokens,
                        time_limit=exp.profile.budget_seconds + 60,
                        # a new seed per probe: a long-lived engine must not serve a second probe's
                        # prompts from the first probe's prefix cache
                        seed=int(time.time() * 1000) % 1_000_003,
                        prompt_format=getattr(pr.target, "prompt_format", "ids"), **remote)
    if workers:
        pr.log(f"kvprobe: {exp.name}: waiting up to {workers.wait_seconds:g} s for {workers.expect} Locust worker(s); "
               f"start each on a load host with: {pr.load.worker_command()}  (they send to {pr.target.url})")
    pr.load.start()


def run_ramp(pr: ProbeRun) -> None:
    """Drive Locust level by level until the strategy stops, then add deep levels until the
    plateau is confirmed — within the time budget and the profile's max_users."""
    from kvprobe.load.ramps import make_ramp

    strategy = make_ramp(pr.exp.profile.ramp, pr.prediction.limit)
    history = []
    while (users := strategy.next_level(history)) is not None:
        if not run_level(pr, users):
            return
        history.append(level_result(pr.result.levels[-1]))
    if pr.exp.profile.ramp.strategy == "explicit":
        return  # the levels as written, and no others
    tol = pr.exp.tolerances
    precision = max(tol.rejection_point, tol.rejection_point_relative * float(pr.prediction.limit))
    for _ in range(MAX_ADDED_LEVELS):
        rejection = _plan_rejection(pr)
        added = plateau.deep_levels_to_add(rejection, [lv.users for lv in pr.result.levels],
                                           max_users=pr.exp.profile.ramp.max_users,
                                           precision=precision if pr.dialect.RUNNING_GAUGE_EXACT else None)
        if not added:
            return
        why = (f"{len(rejection.deep_levels)} deep level(s) so far" if not rejection.confirmed else
               f"the plateau is {rejection.rejection_point:.2f} ± {rejection.uncertainty or 0:.2f}")
        pr.log(f"  adding level {added[0]}: {why}; the plateau is measured where the queue rarely empties")
        if not run_level(pr, added[0]):
            return


MAX_ADDED_LEVELS = 6  # deep levels the ramp may add after its own, to confirm the plateau


def run_level(pr: ProbeRun, users: int) -> bool:
    """Hold one level and record it; False when the time budget does not allow it."""
    if time.monotonic() + pr.hold > pr.deadline:
        pr.log(f"time budget reached before level {users}; stopping the ramp")
        return False
    asked = time.time()
    pr.load.set_users(users)
    t_start = pr.load.wait_level(users, since=asked, timeout=max(30.0, users / 50))
    _hold_level(pr.target, pr.load, until=t_start + pr.hold)
    window = analysis.LevelWindow(users=users, t_start=t_start, t_end=time.time())
    pr.windows.append(window)
    level = analysis.level_stats(pr.sampler.series.arrays(), [window], warmup_fraction=pr.exp.profile.hold.warmup,
                                 counter_lazy=pr.dialect.PREEMPTION_COUNTER_LAZY)[0]
    pr.result.levels.append(level)
    gauge = "engine gauge" if pr.dialect.RUNNING_GAUGE_EXACT else "engine gauge, sampled"
    pr.log(f"  users {users:>4}: running {_mean(level.running_mean)} ({gauge})  waiting {_mean(level.waiting_mean)}  "
           f"usage gauge {_pct(level.usage_mean)}  preemptions {_count(level.preemptions)}  (steady means)")
    return True


def _plan_rejection(pr: ProbeRun):
    """The plateau as the levels measured so far show it, to plan deep levels. A sampled gauge
    reads low except at full steps, so its highest reading stands in for running here."""
    levels = pr.result.levels
    if not pr.dialect.RUNNING_GAUGE_EXACT:
        levels = [replace(lv, running_mean=lv.engine_running_max) for lv in levels]
    return plateau.find_rejection_point(levels)


def _pct(x) -> str:
    return "  —  " if x is None or x != x else f"{x:5.1%}"


def _mean(x) -> str:
    return "     —" if x is None or x != x else f"{x:6.2f}"


def _count(x) -> str:
    return "—" if x is None or x != x else f"{x:g}"


def _hold_level(target, load, *, until: float) -> None:
    """Wait out a level, failing fast when the engine or Locust dies."""
    while (left := until - time.time()) > 0:
        if not target.alive():
            raise TargetError("the engine died during the probe", log_tail=target.log_tail())
        if not load.alive():
            raise ProbeError(f"the Locust subprocess exited during the ramp (rc={load.returncode}): {load.log_tail()}")
        if load.expect_workers:
            load.raise_if_worker_lost()
        time.sleep(min(0.2, left))


# Checks that read the series after the load stops: the sampler watches the drain for them.
DRAIN_CHECKS = ("leak", "replica_leak")


def stop_load(pr: ProbeRun) -> None:
    """Stop Locust, watch the drain when a check needs it, stop the sampler, read the records."""
    pr.t_stop = time.time()
    pr.load.stop()
    pr.result.client = pr.load.client_health()
    if set(DRAIN_CHECKS) & {*pr.exp.checks, pr.exp.expect_fail}:
        wait_drained(pr.sampler, seconds=pr.exp.profile.drain_seconds)
    pr.series = pr.sampler.stop()
    pr.replica_series = getattr(pr.sampler, "replica_series", None)
    pr.sampler = None
    pr.records = pr.load.records()
    for line in pr.load.clock_warnings() if pr.load.expect_workers else ():
        pr.log(f"kvprobe: {pr.exp.name}: warning: {line}")


def wait_drained(sampler, *, seconds: float) -> None:
    """Give the engine `seconds` to return running, waiting and usage to zero (polls, bounded)."""
    end = time.time() + seconds
    while time.time() < end:
        s = sampler.latest()
        if s is not None and s.ok and not (s.running or s.waiting or s.usage):
            # a few more samples, so the series shows the zero holding rather than one reading
            seen = len(sampler.series)
            while len(sampler.series) < seen + 3 and time.time() < end:
                time.sleep(0.05)
            return
        time.sleep(0.1)


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
        pr.target.stop()
    pr.result.finished = time.time()
    pr.result.artifacts = report.write_artifacts(pr.result, pr.artifacts, series=pr.series, records=pr.records,
                                                 windows=pr.windows)


def run_probe(exp, options: ProbeOptions) -> ProbeResult:
    """Run one probe end to end. Never raises for a failed check; raises KvprobeError for bad input."""
    pr = begin(exp, options)
    try:
        reach_engine(pr)
        start_load(pr)
        run_ramp(pr)
        stop_load(pr)
        analyse(pr)
        judge(pr)
    except KvprobeError as err:
        record_error(pr, err)
    finally:
        close(pr)
    return pr.result


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
