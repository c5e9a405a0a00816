"""One probe, from an Expectation to a ProbeResult: predict, reach the engine, ramp, observe, judge.

A probe is one `ProbeRun` (expectation, prediction, target, load, sampler, windows, records)
moved through named steps — begin, reach_engine, start_load, run_ramp, stop_load, analyse, judge,
close — each taking what it needs from it; the console, the pytest plugin and the tests all enter
through `run_probe(exp, options) -> ProbeResult`. Whatever happens (a failed check, a dead engine, Ctrl-C, SIGTERM),
`run_probe` stops Locust, the sampler and the engine it started, and writes what it has.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvprobe import __version__, analysis, plateau, verdict
from kvprobe.engines import get_dialect
from kvprobe.errors import KvprobeError, ProbeError, TargetError

SCHEMA_VERSION = 2  # 2: verdict.status, diagnosis, plateau uncertainty, absent metrics as null


@dataclass
class ProbeOptions:
    artifacts_dir: Path
    url: str | None = None  # attach here instead of launching
    engine_command: list[str] | None = None  # replaces the dialect's launch command
    tolerances: dict[str, float] = field(default_factory=dict)  # overrides by name
    budget_seconds: float | None = None
    profile: str | None = None  # a profile name or path replacing the expectation's
    log: Callable[[str], None] = lambda line: None


# The three outcomes of a probe (console exit codes 0, 1 and 3; pytest passed, failed and error).
PASSED, FAILED, ERROR = "passed", "failed", "error"


@dataclass
class ProbeResult:
    expectation: object
    ledger: dict | None = None
    facts: object = None
    levels: list = field(default_factory=list)
    rejection: object = None
    diagnosis: object = None  # kvprobe.diagnosis.Diagnosis: the limit the measurement shows
    drain: object = None
    client: object = None
    checks: list[verdict.CheckResult] = field(default_factory=list)
    discovery: dict | None = None  # what the engine publishes vs the expectation (discover.Discovery)
    artifacts: dict[str, str] = field(default_factory=dict)
    error: str | None = None  # why the probe could not complete, if it could not
    log_tail: str | None = None  # the engine's (or Locust's) last log lines behind `error`
    fleet: dict | None = None  # a fleet target: per-replica figures per level (kvprobe/fleet/checks.py)
    started: float = field(default_factory=time.time)
    finished: float | None = None

    @property
    def expected_failure(self) -> str | None:
        return self.expectation.expect_fail

    def check(self, name: str) -> verdict.CheckResult | None:
        return next((c for c in self.checks if c.name == name), None)

    @property
    def status(self) -> str:
        """passed: every selected check passes (a fault expectation: its check fails, for a reason).
        failed: a check disagrees. error: the probe could not measure — the engine was unreachable
        or died, the client saturated, no metrics, too few deep levels — so nothing was judged.
        A definite disagreement wins over a check that could not be judged."""
        if self.error:
            return ERROR
        if self.expected_failure:
            target = self.check(self.expected_failure)
            if target is None or target.inconclusive:
                return ERROR
            return FAILED if target.passed else PASSED
        if not self.checks:
            return ERROR
        if any(not c.passed and not c.inconclusive for c in self.checks):
            return FAILED
        return ERROR if any(c.inconclusive for c in self.checks) else PASSED

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def status_reason(self) -> str:
        """One line: why the status is what it is."""
        if self.error:
            return self.error
        if self.expected_failure:
            target = self.check(self.expected_failure)
            if target is None or target.inconclusive:
                return f"could not measure {self.expected_failure}" + (f": {target.reason}" if target else "")
            return (f"{self.expected_failure} failed as the fault expects" if not target.passed
                    else f"{self.expected_failure} passed, but the fault expectation needs it to fail")
        failed = [c.name for c in self.checks if not c.passed and not c.inconclusive]
        if failed:
            return "failed: " + ", ".join(failed)
        unjudged = [c for c in self.checks if c.inconclusive]
        if unjudged:
            return "could not measure " + "; ".join(f"{c.name}: {c.reason}" for c in unjudged)
        return "every check passed" if self.checks else "no check was run"

    def to_dict(self) -> dict:
        exp = self.expectation
        facts = self.facts
        return {
            "schema": f"kvprobe.result/{SCHEMA_VERSION}",
            "kvprobe_version": __version__,
            "expectation": {"name": exp.name, "path": str(exp.path), "engine": exp.engine, "version": exp.version,
                            "model": exp.model, "flags": exp.flags, "expect_fail": exp.expect_fail},
            "environment": {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count(), "started": self.started, "finished": self.finished},
            "prediction": self.ledger,
            "engine_facts": _facts_dict(facts),
            "discovery": self.discovery,
            "levels": [_plain(x) for x in self.levels],
            "rejection": _plain(self.rejection),
            "diagnosis": _plain(self.diagnosis),
            "drain": _plain(self.drain),
            "client": _plain(self.client),
            "checks": [c.to_dict() for c in self.checks],
            "fleet": _plain(self.fleet),
            "verdict": {"status": self.status, "passed": self.passed, "reason": self.status_reason,
                        "error": self.error, "log_tail": self.log_tail},
            "artifacts": self.artifacts,
        }


def _plain(obj):
    """JSON-ready: dataclasses as dicts, and a measurement that is absent (NaN) as null, never 0."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (int, str, bool)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _plain(getattr(obj, k)) for k in obj.__dataclass_fields__}
    return str(obj)


def _facts_dict(facts) -> dict | None:
    if facts is None:
        return None
    out = _plain(facts)
    out.pop("headers", None)  # never written: may carry the attached target's API key
    return out


# --- the steps --------------------------------------------------------------------------------


def predict(exp, users: int | None = None):
    """The ledger for an expectation (raises ConfigError on impossible settings)."""
    from kvprobe.fleet import probe_steps as fleet
    from kvprobe.spec import ledger_inputs
    from kvprobe.theory.ledger import build_ledger

    ledger = build_ledger(ledger_inputs(exp, users=users))
    return fleet.ledger(exp, ledger) if fleet.is_fleet(exp) else ledger  # one replica's ledger, and the fleet's


def open_target(exp, options: ProbeOptions, artifacts: Path, dialect=None):
    """Launch the emulator or the engine in its own process group, or attach to a URL."""
    from kvprobe.engines.launcher import Target, free_port

    dialect = dialect or get_dialect(exp.engine)
    if exp.target.fleet:
        from kvprobe.fleet.probe_steps import open_fleet

        return open_fleet(exp, options, artifacts, dialect)
    url = options.url or exp.target.url
    if url:
        return Target.attach(url, engine=exp.engine, api_key_env=exp.target.api_key_env)
    port = exp.target.port or free_port()
    if exp.target.mode == "shadow":
        from kvprobe.shadow.target import open_shadow

        return open_shadow(exp, port=port, log_path=artifacts / "engine.log")
    # The engine loads `model` (or `target.model`) and serves it as `served_model_name`: the name the
    # load sends.
    served = exp.served_model_name if exp.served_model_name not in (None, exp.model) else None
    if exp.target.mode == "emulator":
        flags = {**exp.flags, "served-model-name": served} if served else exp.flags
        argv = dialect.emulator_command(exp.model, flags, host="127.0.0.1", port=port,
                                        extra=emulator_args(exp.target.emulator), version=exp.version)
    else:
        from kvprobe.spec import launched_model, served_name

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

    from kvprobe.fleet.probe_steps import as_target_prompt
    from kvprobe.oneshot import post_completion, unique_prompt

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
    import math

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
    (artifacts / "ledger.txt").write_text(ledger.render() + "\n")
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
    from kvprobe.discover import discover

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
        (pr.artifacts / "ledger.txt").write_text(pr.ledger.render() + "\n")
        if (before.limit, before.binding) != (pr.prediction.limit, pr.prediction.binding):
            pr.log(f"kvprobe: {exp.name}: from what the engine publishes: admission limit {pr.prediction.limit:g} "
                   f"({pr.prediction.binding} binds); the expectation alone gave {before.limit:g} ({before.binding})")
    pr.exp = exp
    for line in disc.lines(pr.ledger):
        pr.log(f"kvprobe: {line}")


def start_load(pr: ProbeRun) -> None:
    """The /metrics sampler, then Locust at zero users."""
    from kvprobe.load.runner import LocustRun
    from kvprobe.observe import Sampler

    exp, shape = pr.exp, pr.exp.profile.request
    if exp.target.fleet:
        from kvprobe.fleet.probe_steps import sampler

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


def stop_load(pr: ProbeRun) -> None:
    """Stop Locust, watch the drain when a check needs it, stop the sampler, read the records."""
    pr.t_stop = time.time()
    pr.load.stop()
    pr.result.client = pr.load.client_health()
    if "leak" in pr.exp.checks or pr.exp.expect_fail == "leak":
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
    from kvprobe import report

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


def analyse(pr: ProbeRun) -> None:
    """Per-level figures with every record flushed, reconciled with the engine's gauge; the
    rejection point; the limit the measurement shows; the drain."""
    from kvprobe.diagnosis import diagnose

    result, dialect, exp = pr.result, pr.dialect, pr.exp
    arrays = pr.series.arrays()
    metrics_ok = bool(arrays["ok"].any()) if len(arrays["ok"]) else False
    levels = analysis.level_stats(arrays, pr.windows, warmup_fraction=exp.profile.hold.warmup, records=pr.records,
                                  lead_steps=dialect.FIRST_TOKEN_LEAD_STEPS,
                                  counter_lazy=dialect.PREEMPTION_COUNTER_LAZY)
    result.levels = analysis.reconcile(levels, gauge_exact=dialect.RUNNING_GAUGE_EXACT, metrics_ok=metrics_ok)
    result.rejection = plateau.find_rejection_point(result.levels)
    pool_units = _pool_units(result.ledger)
    if exp.target.fleet:
        from kvprobe.fleet import probe_steps as fleet

        fleet.analyse(pr, pool_units)  # per-replica figures; a policy that splits unevenly sets the plateau's prediction
        pool_units = pool_units and pool_units * fleet.replicas(exp)  # the summed series' pool
    tol = exp.tolerances
    limit = float(pr.prediction.limit)
    result.diagnosis = diagnose(
        prediction=pr.prediction, rejection=result.rejection, levels=result.levels,
        allowance=max(tol.rejection_point, tol.rejection_point_relative * limit), usage_tol=tol.usage_gap,
        client=result.client, reported=result.facts.reported, config=pr.ledger.scheduler_config, dialect=dialect,
        prompt_tokens=exp.profile.request.prompt_tokens, output_tokens=exp.profile.request.output_tokens,
        reported_agrees=_reported_agrees(pr))
    result.drain = analysis.drain_check(arrays, pr.t_stop, deadline_s=exp.profile.drain_seconds,
                                        pool_units=pool_units)


def _reported_agrees(pr: ProbeRun) -> bool | None:
    reported = verdict.check_reported_capacity(pr.result.ledger, pr.result.facts.reported,
                                               pr.exp.tolerances.reported_capacity)
    return None if reported.inconclusive else reported.passed


def judge(pr: ProbeRun) -> None:
    """Every selected check (and the expected failure) against the prediction."""
    result, exp, prediction = pr.result, pr.exp, pr.prediction
    tol = exp.tolerances
    shape = exp.profile.request
    saturated = result.client is not None and result.client.saturated
    unit = "blocks" if exp.engine == "vllm" else "tokens"
    reported = verdict.check_reported_capacity(result.ledger, result.facts.reported, tol.reported_capacity)
    agrees = None if reported.inconclusive else reported.passed
    implied = engine_implied(pr.ledger.scheduler_config, exp, result.facts.reported)
    if exp.target.fleet:
        from kvprobe.fleet import probe_steps as fleet

        implied = fleet.scale(implied, exp)  # the reported pool x R replicas
    judged = {"reported_agrees": agrees, "implied": implied, "diagnosis": result.diagnosis}
    weights = result.rejection.weights if result.rejection is not None else {}
    disagreeing = [lv for lv in result.levels if lv.disagrees and weights.get(lv.users, 0) > 0]
    checks = {
        "reported_capacity": lambda: reported,
        "rejection_point": lambda: verdict.check_rejection_point(prediction, result.rejection, tol,
                                                                 client_saturated=saturated, disagreeing=disagreeing,
                                                                 client_reason=result.client.reason if saturated else "",
                                                                 **judged),
        "no_preemption": lambda: verdict.check_no_preemption(prediction, result.rejection, tol,
                                                             unpredicted=_unpredicted_preemptions(pr), **judged),
        "leak": lambda: verdict.check_leak(result.drain, _pool_units(result.ledger), unit),
        "usage_gap": lambda: verdict.check_usage_gap(prediction, result.rejection, tol.usage_gap, **judged),
        "exactness": lambda: verdict.check_exactness(pr.records, shape.prompt_tokens, shape.output_tokens),
        "length_limit": lambda: _length_limit(pr),
    }
    if exp.target.fleet:
        checks.update(fleet.checks(pr, _pool_units(result.ledger), unit))
    wanted = list(exp.checks)
    if exp.expect_fail and exp.expect_fail not in wanted:
        wanted.append(exp.expect_fail)
    result.checks = [checks[name]() for name in wanted]


# Preemptions a level must show before they count against a policy that predicts none: one or two
# can come from the moment a level's users arrive together, before the steady state.
MIN_UNPREDICTED_PREEMPTIONS = 3


def _unpredicted_preemptions(pr: ProbeRun) -> list[tuple[int, float]]:
    """(N, preemptions) at the levels that preempted although the ledger's simulated steady state at
    that N preempts nothing. One replica's ledger says nothing about a fleet's summed counter."""
    from kvprobe.theory.ledger import build_ledger

    if pr.exp.target.fleet:
        return []
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
    from kvprobe.oneshot import post_completion, unique_prompt

    dialect, target = pr.dialect, pr.target
    limit = dialect.length_limit(pr.result.facts.reported)
    if limit is None:
        return verdict.check_length_limit(None, 400, "")
    max_len, expected_status = limit
    out = pr.exp.profile.request.output_tokens
    prompt = max(1, max_len - out + 1)
    body = dialect.completion_body(unique_prompt(prompt, 1), out, model=pr.model, stream=False)
    from kvprobe.fleet.probe_steps import as_target_prompt

    body = as_target_prompt(body, target)
    shot = post_completion(target.url, body, path=dialect.COMPLETIONS_PATH, headers=target.headers, timeout=30)
    return verdict.check_length_limit(shot, expected_status, f"P+O = {prompt}+{out} > {max_len}")


def apply_overrides(exp, options: ProbeOptions):
    """Tolerance, budget and profile overrides from the command line or pytest options."""
    from kvprobe.spec import override_profile

    if options.profile:
        exp = override_profile(exp, options.profile)  # re-checks P+O against the engine's limits
    changes = {}
    if options.tolerances:
        changes["tolerances"] = replace(exp.tolerances, **options.tolerances)
    if options.budget_seconds:
        changes["profile"] = replace(exp.profile, budget_seconds=options.budget_seconds)
    return replace(exp, **changes) if changes else exp
