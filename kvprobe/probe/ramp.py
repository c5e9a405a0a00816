"""The load steps of a probe: the sampler and Locust started, the ramp driven level by level (and
deep levels added until the plateau is confirmed), the load stopped and the drain watched. Each
reads and fills a `kvprobe.probe.state.ProbeRun`."""

from __future__ import annotations

import time
from dataclasses import replace

from kvprobe.analysis import levels as analysis
from kvprobe.analysis import plateau
from kvprobe.errors import ProbeError, TargetError
from kvprobe.load.ramps import LevelResult, make_ramp
from kvprobe.probe.state import ProbeRun


def level_result(stats):
    # Every engine queues a request for up to one step after it arrives, and a closed-loop user
    # spends part of its cycle between requests, so "waiting > 0" or "running < N" alone is not
    # saturation; a queue of a tenth of the users, or running far below N, is.
    saturated = stats.waiting_mean >= max(1.0, 0.1 * stats.users) or stats.running_mean < 0.8 * stats.users
    return LevelResult(users=stats.users, running=stats.running_mean, waiting=stats.waiting_mean,
                       preemption_rate=stats.preemption_rate_per_s, saturated=saturated)


def start_load(pr: ProbeRun) -> None:
    """The /metrics sampler, then Locust at zero users."""
    from kvprobe.load.runner import LocustRun

    exp, shape = pr.exp, pr.exp.profile.request
    pr.sampler = pr.target.sampler(interval=exp.profile.sample_interval)
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
                        prompt_format=pr.target.prompt_format, **remote)
    if workers:
        pr.log(f"kvprobe: {exp.name}: waiting up to {workers.wait_seconds:g} s for {workers.expect} Locust worker(s); "
               f"start each on a load host with: {pr.load.worker_command()}  (they send to {pr.target.url})")
    pr.load.start()


def run_ramp(pr: ProbeRun) -> None:
    """Drive Locust level by level until the strategy stops, then add deep levels until the
    plateau is confirmed — within the time budget and the profile's max_users."""
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
        # long enough for an engine's idle report (SGLang's 30 s), unless it reads zero sooner
        wait_drained(pr.sampler, seconds=analysis.drain_window(pr.exp.profile.drain_seconds,
                                                               pr.dialect.IDLE_REPORT_SECONDS))
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
