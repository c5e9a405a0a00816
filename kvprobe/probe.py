"""One probe, from an Expectation to a ProbeResult: predict, reach the engine, ramp, observe, judge.

The steps are small functions over plain data so that the console, the pytest plugin and the
tests drive the same code. Whatever happens (a failed check, a dead engine, Ctrl-C, SIGTERM),
`run_probe` stops Locust, the sampler and the engine it started, and writes what it has.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvprobe import __version__, analysis, verdict
from kvprobe.engines import get_dialect
from kvprobe.errors import KvprobeError, ProbeError, TargetError

SCHEMA_VERSION = 1


@dataclass
class ProbeOptions:
    artifacts_dir: Path
    url: str | None = None  # attach here instead of launching
    engine_command: list[str] | None = None  # replaces the dialect's launch command
    tolerances: dict[str, float] = field(default_factory=dict)  # overrides by name
    budget_seconds: float | None = None
    profile: str | None = None  # a profile name or path replacing the expectation's
    log: Callable[[str], None] = lambda line: None


@dataclass
class ProbeResult:
    expectation: object
    ledger: dict | None = None
    facts: object = None
    levels: list = field(default_factory=list)
    rejection: object = None
    drain: object = None
    client: object = None
    checks: list[verdict.CheckResult] = field(default_factory=list)
    artifacts: dict[str, str] = field(default_factory=dict)
    error: str | None = None  # why the probe could not complete, if it could not
    log_tail: str | None = None  # the engine's (or Locust's) last log lines behind `error`
    started: float = field(default_factory=time.time)
    finished: float | None = None

    @property
    def expected_failure(self) -> str | None:
        return getattr(self.expectation, "expect_fail", None)

    def check(self, name: str) -> verdict.CheckResult | None:
        return next((c for c in self.checks if c.name == name), None)

    @property
    def passed(self) -> bool:
        """All selected checks pass — or, for a fault expectation, exactly the expected check fails."""
        if self.error:
            return False
        if self.expected_failure:
            target = self.check(self.expected_failure)
            return target is not None and not target.passed and not target.inconclusive
        return bool(self.checks) and all(c.passed for c in self.checks)

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
            "levels": [_plain(x) for x in self.levels],
            "rejection": _plain(self.rejection),
            "drain": _plain(self.drain),
            "client": _plain(self.client),
            "checks": [c.to_dict() for c in self.checks],
            "verdict": {"passed": self.passed, "error": self.error, "log_tail": self.log_tail},
            "artifacts": self.artifacts,
        }


def _plain(obj):
    if obj is None or isinstance(obj, (int, float, str, bool, list, dict)):
        return obj
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
    from kvprobe.spec import ledger_inputs
    from kvprobe.theory.ledger import build_ledger

    return build_ledger(ledger_inputs(exp, users=users))


def open_target(exp, options: ProbeOptions, artifacts: Path):
    """Launch the emulator or the engine in its own process group, or attach to a URL."""
    from kvprobe.engines.launcher import Target, free_port

    dialect = get_dialect(exp.engine)
    url = options.url or exp.target.url
    if url:
        return Target.attach(url, engine=exp.engine, api_key_env=exp.target.api_key_env)
    port = exp.target.port or free_port()
    if exp.target.mode == "shadow":
        from kvprobe.shadow.target import open_shadow

        return open_shadow(exp, port=port, log_path=artifacts / "engine.log")
    from kvprobe.spec import launched_model, served_name

    model, flags = served_name(exp), exp.flags
    if exp.target.mode == "emulator":
        argv = dialect.emulator_command(model, flags, host="127.0.0.1", port=port,
                                        extra=emulator_args(exp.target.emulator))
    else:
        # The engine loads `target.model` (or `model:`) and serves it under the name clients send.
        if launched_model(exp) != model:
            flags = {**flags, "served-model-name": model}
        # A command replaces the engine's binary ("vllm serve", "python -m sglang.launch_server");
        # the model and flags follow as the dialect writes them.
        binary = list(options.engine_command or exp.target.command or ()) or None
        argv = dialect.launch_command(launched_model(exp), flags, host="127.0.0.1", port=port, binary=binary)
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


def calibrate(target, exp, model: str | None) -> float:
    """Seconds one request takes alone: the unit of a hold given in request lifetimes."""
    from kvprobe.oneshot import post_completion, unique_prompt

    dialect = get_dialect(exp.engine)
    shape = exp.profile.request
    body = dialect.completion_body(unique_prompt(shape.prompt_tokens, 0), shape.output_tokens, model=model, stream=True)
    shot = post_completion(target.url, body, path=dialect.COMPLETIONS_PATH, headers=target.headers, timeout=120)
    if not shot.ok:
        raise ProbeError(f"calibration request failed: HTTP {shot.status} {shot.body[:300]}")
    if (shot.prompt_tokens, shot.completion_tokens) != (shape.prompt_tokens, shape.output_tokens):
        raise ProbeError(
            f"calibration usage {shot.prompt_tokens}/{shot.completion_tokens} != requested "
            f"{shape.prompt_tokens}/{shape.output_tokens}: the engine does not honour fixed lengths"
        )
    return shot.seconds


def hold_seconds(exp, lifetime: float | None) -> float:
    hold = exp.profile.hold
    if hold.lifetimes:
        return max(hold.lifetimes * (lifetime or 1.0), 2.0)
    return float(hold.seconds)


def level_result(stats):
    from kvprobe.load.ramps import LevelResult

    # Every engine queues a request for up to one step after it arrives, and a closed-loop user
    # spends part of its cycle between requests, so "waiting > 0" or "running < N" alone is not
    # saturation; a queue of a tenth of the users, or running far below N, is.
    saturated = stats.waiting_mean >= max(1.0, 0.1 * stats.users) or stats.running_mean < 0.8 * stats.users
    return LevelResult(users=stats.users, running=stats.running_mean, waiting=stats.waiting_mean,
                       preemption_rate=stats.preemption_rate_per_s, saturated=saturated)


def run_ramp(exp, target, run, sampler, strategy, *, hold: float, deadline: float, log) -> tuple[list, list]:
    """Drive Locust level by level until the strategy stops or the time budget runs out."""
    history, windows, stats = [], [], []
    warmup = exp.profile.hold.warmup
    while (users := strategy.next_level(history)) is not None:
        if time.monotonic() + hold > deadline:
            log(f"time budget reached before level {users}; stopping the ramp")
            break
        asked = time.time()
        run.set_users(users)
        t_start = run.wait_level(users, since=asked, timeout=max(30.0, users / 50))
        _hold_level(target, run, until=t_start + hold)
        window = analysis.LevelWindow(users=users, t_start=t_start, t_end=time.time())
        windows.append(window)
        level = analysis.level_stats(sampler.series.arrays(), [window], warmup_fraction=warmup,
                                     records=None)[0]
        stats.append(level)
        history.append(level_result(level))
        log(f"  users {users:>4}: running {level.running_mean:6.2f}  waiting {level.waiting_mean:6.2f}  "
            f"usage {_pct(level.usage_mean)}  preemptions {level.preemptions:g}")
    return windows, stats


def _pct(x) -> str:
    return "  —  " if x is None or x != x else f"{x:5.1%}"


def _hold_level(target, run, *, until: float) -> None:
    """Wait out a level, failing fast when the engine or Locust dies."""
    while (left := until - time.time()) > 0:
        if not target.alive():
            raise TargetError("the engine died during the probe", log_tail=target.log_tail())
        if not run.alive():
            raise ProbeError(f"the Locust subprocess exited during the ramp (rc={run.returncode}): {run.log_tail()}")
        time.sleep(min(0.2, left))


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


def run_probe(exp, options: ProbeOptions) -> ProbeResult:
    """Run one probe end to end. Never raises for a failed check; raises KvprobeError for bad input."""
    from kvprobe import report
    from kvprobe.load.ramps import make_ramp
    from kvprobe.load.runner import LocustRun
    from kvprobe.observe import Sampler

    exp = apply_overrides(exp, options)
    artifacts = Path(options.artifacts_dir)
    artifacts.mkdir(parents=True, exist_ok=True)
    log = options.log
    result = ProbeResult(expectation=exp)
    ledger = predict(exp)
    result.ledger = ledger.to_dict()
    (artifacts / "ledger.txt").write_text(ledger.render() + "\n")
    prediction = ledger.admission
    dialect = get_dialect(exp.engine)
    shape = exp.profile.request
    deadline = time.monotonic() + exp.profile.budget_seconds
    target = run = sampler = None
    windows, series, records = [], None, []
    try:
        log(f"kvprobe: {exp.name}: predicted admission limit {prediction.limit:g} ({prediction.binding} binds)")
        target = open_target(exp, options, artifacts)
        result.facts = target.facts()
        model = exp.served_model_name or exp.model
        lifetime = calibrate(target, exp, model)
        hold = hold_seconds(exp, lifetime)
        log(f"kvprobe: engine up at {target.url}; one request takes {lifetime:.2f}s alone; hold {hold:.1f}s per level")
        sampler = Sampler(target.url, dialect.METRICS, interval=exp.profile.sample_interval, headers=target.headers)
        sampler.start()
        run = LocustRun(target.url, model=model, prompt_tokens=shape.prompt_tokens, output_tokens=shape.output_tokens,
                        workdir=artifacts / "locust", api_key_env=exp.target.api_key_env,
                        processes=exp.profile.processes, stream=shape.stream, engine=exp.engine,
                        time_limit=exp.profile.budget_seconds + 60,
                        # a new seed per probe: a long-lived engine must not serve a second probe's
                        # prompts from the first probe's prefix cache
                        seed=int(time.time() * 1000) % 1_000_003)
        run.start()
        strategy = make_ramp(exp.profile.ramp, prediction.limit)
        windows, result.levels = run_ramp(exp, target, run, sampler, strategy, hold=hold, deadline=deadline, log=log)
        t_stop = time.time()
        run.stop()
        result.client = run.client_health()
        if "leak" in exp.checks or exp.expect_fail == "leak":
            wait_drained(sampler, seconds=exp.profile.drain_seconds)
        series = sampler.stop()
        sampler = None
        records = run.records()
        _analyse(result, exp, prediction, series, records, t_stop, dialect, target, windows,
                 ledger_config=ledger.scheduler_config)
    except KvprobeError as err:
        first, _, rest = str(err).partition("\n")
        result.error = first
        # The reason is one line; what the engine or Locust said last is kept beside it.
        result.log_tail = (getattr(err, "log_tail", "") or rest).strip() or None
        if isinstance(err, TargetError) and target is not None:
            result.error += f" (engine log: {artifacts / 'engine.log'})"
        log(f"kvprobe: {exp.name}: {result.error}")
    finally:
        # Order matters: stop the load before the engine so no request sees a dying server.
        if run is not None:
            run.stop()
            if not records:
                records = _safe(run.records, [])
        if sampler is not None:
            series = sampler.stop()
        if target is not None:
            target.stop()
        result.finished = time.time()
        result.artifacts = report.write_artifacts(result, artifacts, series=series, records=records, windows=windows)
    return result


def _safe(fn, default):
    try:
        return fn()
    except Exception:  # noqa: BLE001 — partial artifacts must never mask the original failure
        return default


def _analyse(result, exp, prediction, series, records, t_stop, dialect, target, windows,
             ledger_config=None) -> None:
    arrays = series.arrays()
    metrics_ok = bool(arrays["ok"].any()) if len(arrays["ok"]) else False
    exact = getattr(dialect, "RUNNING_GAUGE_EXACT", True)
    # Levels of which the sampler saw nothing: /metrics lost its families (or died) halfway.
    blind = any(lv.running_mean != lv.running_mean for lv in result.levels)
    if not metrics_ok or not exact or blind:
        # Recompute every level now that all request records are flushed.
        levels = analysis.level_stats(arrays, windows, warmup_fraction=exp.profile.hold.warmup, records=records,
                                      lead_steps=getattr(dialect, "FIRST_TOKEN_LEAD_STEPS", 1))
        if not metrics_ok or not exact:
            levels = analysis.use_client_counts(levels, waiting_too=not metrics_ok)
        # A blind level falls back to the streams rather than entering the fit as NaN.
        analysis.use_client_counts([lv for lv in levels if lv.running_mean != lv.running_mean], waiting_too=True)
        result.levels = levels
    result.rejection = analysis.find_rejection_point(result.levels)
    result.drain = analysis.drain_check(arrays, t_stop, deadline_s=exp.profile.drain_seconds,
                                        pool_units=_pool_units(result.ledger))
    tol = exp.tolerances
    shape = exp.profile.request
    saturated = bool(getattr(result.client, "saturated", False))
    unit = "blocks" if exp.engine == "vllm" else "tokens"
    reported = verdict.check_reported_capacity(result.ledger, result.facts.reported, tol.reported_capacity)
    agrees = None if reported.inconclusive else reported.passed
    implied = engine_implied(ledger_config, exp, result.facts.reported)
    judged = {"reported_agrees": agrees, "implied": implied}
    checks = {
        "reported_capacity": lambda: reported,
        "rejection_point": lambda: verdict.check_rejection_point(prediction, result.rejection, tol,
                                                                 client_saturated=saturated, **judged),
        "no_preemption": lambda: verdict.check_no_preemption(prediction, result.rejection, tol, **judged),
        "leak": lambda: verdict.check_leak(result.drain, _pool_units(result.ledger), unit),
        "usage_gap": lambda: verdict.check_usage_gap(prediction, result.rejection, tol.usage_gap, **judged),
        "exactness": lambda: verdict.check_exactness(records, shape.prompt_tokens, shape.output_tokens),
        "length_limit": lambda: _length_limit(exp, result, target, dialect),
    }
    wanted = list(exp.checks)
    if exp.expect_fail and exp.expect_fail not in wanted:
        wanted.append(exp.expect_fail)
    result.checks = [checks[name]() for name in wanted]


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
        return predict_admission(replace(config, **{field_name: int(value)}), shape.prompt_tokens, shape.output_tokens)
    except KvprobeError:
        return None


def _pool_units(ledger: dict | None) -> int | None:
    if not ledger:
        return None
    cap = ledger["capacity"]
    return cap.get("num_blocks") or cap.get("kv_tokens")


def _length_limit(exp, result, target, dialect):
    """Send P+O one token past the engine's length limit and expect the engine's refusal."""
    from kvprobe.oneshot import post_completion, unique_prompt

    limit = dialect.length_limit(result.facts.reported) if hasattr(dialect, "length_limit") else None
    if limit is None:
        return verdict.check_length_limit(None, 400, "")
    max_len, expected_status = limit
    out = exp.profile.request.output_tokens
    prompt = max(1, max_len - out + 1)
    body = dialect.completion_body(unique_prompt(prompt, 1), out, model=exp.served_model_name or exp.model, stream=False)
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
