"""The ramp of a probe: Locust driven level by level (and deep levels added until the plateau is
confirmed), each level held and recorded. Reads and fills a `kvprobe.probe.state.ProbeRun`; the
load's start and stop around it are `kvprobe.probe.load_steps`, a level waited out `kvprobe.probe.hold`."""

from __future__ import annotations

import math
import time
from dataclasses import replace

from kvprobe.analysis import levels as analysis
from kvprobe.analysis import live, plateau
from kvprobe.analysis.steady import detected_start, fed_since, window_start
from kvprobe.load.health import HEALTH_PERIOD
from kvprobe.load.ramps import LevelResult
from kvprobe.probe.hold import PastBurst, held_past_burst, hold_level
from kvprobe.probe.state import ProbeRun
from kvprobe.probe.strategy import FED_SHARE, SAFE_SHARE, make_ramp, settled, usage_agrees, widest
from kvprobe.theory.prediction import judged_plateau


def level_result(stats, *, gauge_exact: bool = True):
    # Every engine queues a request for up to one step after it arrives, and a closed-loop user
    # spends part of its cycle between requests, so "waiting > 0" or "running < N" alone is not
    # saturation; a queue of a tenth of the users, or running far below N, is.
    saturated = _queued(stats) or stats.running_mean < 0.8 * stats.users
    # a sampled gauge reads low except at full steps: its highest reading stands in for running
    running = stats.running_mean if gauge_exact else stats.engine_running_max
    return LevelResult(users=stats.users, running=running, waiting=stats.waiting_mean,
                       preemption_rate=stats.preemption_rate_per_s, saturated=saturated)


def _queued(stats) -> bool:
    """A queue in the engine: a tenth of the users waiting on average, and at least one."""
    return stats.waiting_mean >= max(1.0, 0.1 * stats.users)


def run_ramp(pr: ProbeRun) -> None:
    """Drive Locust level by level until the strategy stops, then add deep levels until the
    plateau is confirmed — within the time budget and the profile's max_users. The `predict`
    strategy holds each level only until it is steady and precise enough, and stops adding deep
    levels as soon as the rejection point's verdict is settled (`kvprobe.probe.strategy`)."""
    tol, spec = pr.exp.tolerances, pr.exp.profile.ramp
    limit = float(pr.prediction.limit)
    allowance = max(tol.rejection_point, tol.rejection_point_relative * limit)
    strategy = make_ramp(spec, pr.prediction, tolerance=tol.rejection_point, checks=pr.exp.checks)
    adaptive = spec.strategy == "predict"
    pr.result.ramp = {"strategy": spec.strategy, "lifetime_s": pr.lifetime, "levels": [], "note": None}
    try:
        _run_levels(pr, strategy, adaptive=adaptive, allowance=allowance)
        if adaptive:
            _short_of_target(pr, strategy)
    finally:
        _sum_ramp(pr, getattr(strategy, "note", None))


def _run_levels(pr: ProbeRun, strategy, *, adaptive: bool, allowance: float) -> None:
    history = []
    while (users := strategy.next_level(history)) is not None:
        if not run_level(pr, users, allowance=allowance if adaptive else None):
            return
        history.append(level_result(pr.result.levels[-1], gauge_exact=pr.dialect.RUNNING_GAUGE_EXACT))
    if pr.exp.profile.ramp.strategy == "explicit":
        return  # the levels as written, and no others
    precision = allowance if pr.dialect.RUNNING_GAUGE_EXACT else None
    for _ in range(MAX_ADDED_LEVELS):
        rejection = _plan_rejection(pr)
        if adaptive and _settled(pr, _settle_plan(pr, rejection), allowance) and _usage_read(pr, rejection):
            return
        measured = [lv.users for lv in pr.result.levels]
        if adaptive:  # one more deep level at a time, until the verdict is settled
            added = plateau.deep_levels_to_add(rejection, measured, max_users=pr.exp.profile.ramp.max_users,
                                               wanted=len(rejection.deep_levels) + 1)
        else:
            added = plateau.deep_levels_to_add(rejection, measured, max_users=pr.exp.profile.ramp.max_users,
                                               precision=precision)
        if not added:
            return
        why = (f"{len(rejection.deep_levels)} deep level(s) so far" if not rejection.confirmed else
               f"the plateau is {rejection.rejection_point:.2f} ± {rejection.uncertainty or 0:.2f}")
        pr.log(f"  adding level {added[0]}: {why}; the plateau is measured where the queue rarely empties")
        if not run_level(pr, added[0], allowance=allowance if adaptive else None):
            return


def _short_of_target(pr: ProbeRun, strategy) -> None:
    """Say so when the ramp ended (its levels, added levels or budget spent) with the plateau wider
    than the profile's `ramp.uncertainty` asked (a sampled gauge's: as the streams written so far show it)."""
    target = pr.exp.profile.ramp.uncertainty
    if target is None:
        return
    rejection = _settle_plan(pr, _plan_rejection(pr))
    if rejection.uncertainty is not None and rejection.uncertainty > target:
        strategy.say(f"the plateau's ± {rejection.uncertainty:.3g} is wider than the profile's uncertainty "
                     f"{target:.3g} after {len(pr.result.levels)} levels")


def _settled(pr: ProbeRun, rejection, allowance: float) -> bool:
    return settled(rejection, judged_plateau(pr.prediction), allowance, pr.exp.profile.ramp.uncertainty)


def _reads_streams(pr: ProbeRun) -> bool:
    """Does the ramp settle on the streams? With a sampled gauge held to a `ramp.uncertainty`: the
    gauge's live readings cannot show a ± that narrow (its highest readings stand in for running), the
    streams the verdict reads can (`analysis.live`)."""
    return not pr.dialect.RUNNING_GAUGE_EXACT and pr.exp.profile.ramp.uncertainty is not None


def _settle_plan(pr: ProbeRun, plan, window=None):
    """The plateau a verdict is settled on: `plan` (the gauge's), or the streams' where the ramp reads
    them, with `window` (a level still held) read as far as it is written."""
    return plateau.find_rejection_point(_streams_view(pr, window)) if _reads_streams(pr) else plan


def _streams_view(pr: ProbeRun, window=None):
    """The levels held so far (and `window`) as the streams written so far show them (`analysis.live`)."""
    windows = pr.windows + ([window] if window is not None else [])
    records = pr.load.records(in_flight=True)
    return live.streams_levels(pr.sampler.series.arrays(), windows, records, now=time.time(),
                               warmup_fraction=pr.exp.profile.hold.warmup, lead_steps=pr.dialect.FIRST_TOKEN_LEAD_STEPS,
                               counter_lazy=pr.dialect.PREEMPTION_COUNTER_LAZY)


def _usage_read(pr: ProbeRun, rejection) -> bool:
    """With usage_gap selected, the deep levels must also agree on the gauge (`usage_agrees`)."""
    if "usage_gap" not in pr.exp.checks:
        return True
    return usage_agrees(pr.result.levels, rejection.deep_levels, pr.exp.tolerances.usage_gap)


MAX_ADDED_LEVELS = 6  # deep levels the ramp may add after its own, to confirm the plateau
# With a sampled running gauge a saturated level held adaptively stops once its own ~95% half-width
# is this share of the rejection point's allowance: two such deep levels settle a verdict whose gap
# from the prediction is under ~65% of it (and a third is added when they do not). A narrower
# `ramp.uncertainty` narrows it in proportion.
LEVEL_PRECISION_SHARE = 0.5
MIN_STEADY_SAMPLES = 10  # and it holds at least this many samples after its detected warm-up
# ... and at least this long: the load processes record their health once a second and a level is
# starved when most of its steady seconds were (`analysis.client`), so one burst second must not be
# most of them; and a gauge read over one second of a preempting engine (a lifetime of 0.5-0.7 s)
# swung 88-99% between deep levels on the vLLM shadow's prefix-caching shape.
MIN_STEADY_SECONDS = 3.0


def run_level(pr: ProbeRun, users: int, *, allowance: float | None = None) -> bool:
    """Hold one level and record it; False when the time budget does not allow it. With an
    `allowance` the level is held adaptively (`_hold_adaptive`), at most the profile's hold plus
    one request lifetime of warm-up."""
    least = _least_steady(pr) if allowance is not None else pr.hold
    if time.monotonic() + least > pr.deadline:
        pr.log(f"time budget reached before level {users}; stopping the ramp")
        return False
    asked = time.time()
    pr.load.set_users(users, start_jitter=_start_jitter(pr, users) if allowance is not None else None)
    t_start = pr.load.wait_level(users, since=asked, timeout=max(30.0, users / 50))
    if allowance is None:
        hold_level(pr.target, pr.load, until=t_start + pr.hold)
        window = held_past_burst(pr, users, t_start)
    else:
        window = _hold_adaptive(pr, users, t_start, allowance)
    pr.windows.append(window)
    pr.jitters.append(pr.load.level_jitter)
    level = analysis.level_stats(pr.sampler.series.arrays(), [window], warmup_fraction=pr.exp.profile.hold.warmup,
                                 counter_lazy=pr.dialect.PREEMPTION_COUNTER_LAZY)[0]
    pr.result.levels.append(level)
    gauge = "engine gauge" if pr.dialect.RUNNING_GAUGE_EXACT else "engine gauge, sampled"
    held = window.t_end - window.t_start
    lifetimes = f", {held / pr.lifetime:.1f} lifetimes" if pr.lifetime else ""
    pr.log(f"  users {users:>4}: running {_mean(level.running_mean)} ({gauge})  waiting {_mean(level.waiting_mean)}  "
           f"usage gauge {_pct(level.usage_mean)}  preemptions {_count(level.preemptions)}  (steady means; "
           f"held {held:.1f}s{lifetimes})")
    return True


def _start_jitter(pr: ProbeRun, users: int) -> float | None:
    """The spread of an adaptive level's new users' first requests: None (the run's, a lifetime)
    unless no phases need spreading. A level that climbs from one with a queue in the engine sends
    its new requests into that queue, where the engine admits each as a running request ends — at
    the phases those requests already have — so they need no jitter, and the level none of the
    lifetime its steady part would wait for it; a level that steps down has no new users."""
    if not pr.result.levels:
        return None
    before = pr.result.levels[-1]
    if users <= before.users:
        return 0.0
    return 0.0 if _queued(before) else None


def _least_steady(pr: ProbeRun) -> float:
    """The shortest steady window an adaptive level holds: one request lifetime (every running
    request then was admitted at this level), MIN_STEADY_SAMPLES samples and MIN_STEADY_SECONDS."""
    return max(pr.lifetime or 0.0, MIN_STEADY_SAMPLES * pr.exp.profile.sample_interval, MIN_STEADY_SECONDS)


def _hold_adaptive(pr: ProbeRun, users: int, t_start: float, allowance: float):
    """Hold until the level's warm-up is over (detected: `analysis.steady`, and not before the engine
    holds FED_SHARE of the users' requests) and its figures serve
    the verdict — a level below the knee after the least steady window (the no_preemption check's
    clean level: once its cleanliness is decided, `_clean_decided`); a saturated one, with an
    exact gauge, until the rejection point's verdict is settled (or right away when the plateau
    still needs another deep level), with a sampled one until its running mean is precise to
    LEVEL_PRECISION_SHARE of the allowance — or for the most it may take."""
    least = _least_steady(pr)
    longest = t_start + pr.hold + (pr.lifetime or 0.0)
    past_burst = PastBurst(pr, users, t_start, longest)
    clean_read = "no_preemption" in pr.exp.checks  # a level below the knee is the check's clean level
    check_every = max(0.25, 2 * pr.exp.profile.sample_interval)
    halves: list[tuple[float, float]] = []  # (time, the plateau's half-width with this level so far)
    streams_read = -math.inf
    while True:
        hold_level(pr.target, pr.load, until=min(past_burst.longest, time.time() + check_every))
        now = time.time()
        arrays = pr.sampler.series.arrays()
        steady = detected_start(arrays["t"], [arrays["running"], arrays["waiting"]], t_start, now)
        # not steady before the load reached the engine (a flat zero is steady to MSER)
        fed = fed_since(arrays["t"], arrays["running"], arrays["waiting"], t_start, now, FED_SHARE * users)
        # nor before the level's last new user has sent its first request (the start jitter): until
        # then running climbs below the knee, and a window that short is steady to MSER
        steady = max(steady, fed if fed is not None else now, t_start + pr.load.level_jitter)
        window = analysis.LevelWindow(users=users, t_start=t_start, t_end=now, t_steady=steady)
        if now >= past_burst.longest:
            if past_burst.ends(window):
                return past_burst.mark(window)
            continue
        if fed is None or now - steady < least:
            continue
        stats = analysis.level_stats(arrays, [window], counter_lazy=pr.dialect.PREEMPTION_COUNTER_LAZY)[0]
        if stats.too_few_samples:
            continue
        if not level_result(stats).saturated:
            if (not clean_read or _clean_decided(stats, exact_gauge=pr.dialect.RUNNING_GAUGE_EXACT)) \
                    and past_burst.ends(window):
                return past_burst.mark(window)
            continue
        if pr.dialect.RUNNING_GAUGE_EXACT:
            # the plateau with this level as held so far: hold while the verdict is unsettled and
            # this level still narrows it; an unconfirmed plateau needs another deep level instead
            rejection = _plan_rejection(pr, extra=stats)
            if _plateau_served(pr, rejection, allowance, halves, now, least) and past_burst.ends(window):
                return past_burst.mark(window)
            continue
        if _reads_streams(pr):
            if now - streams_read >= HEALTH_PERIOD:  # a read of every record so far: once a health period
                streams_read = now
                if _streams_settle(pr, window, allowance, halves, least) and past_burst.ends(window):
                    return past_burst.mark(window)
            continue
        # a sampled gauge's live mean is not the verdict's figure (the streams are, after the
        # ramp): the level's own precision decides
        se = max(stats.running_se or 0.0, plateau.SE_FLOOR) if stats.running_se is not None else None
        precise = LEVEL_PRECISION_SHARE / SAFE_SHARE * widest(allowance, pr.exp.profile.ramp.uncertainty)
        if se is not None and plateau.Z95 * se <= precise and past_burst.ends(window):
            return past_burst.mark(window)


def _streams_settle(pr: ProbeRun, window, allowance: float, halves: list, least: float) -> bool:
    """May a saturated level of a ramp that reads the streams end? Once its written steady part spans
    the least steady window, as `_hold_adaptive` reads an exact gauge (`_plateau_served`)."""
    levels = _streams_view(pr, window)
    mine = levels[-1] if levels and levels[-1].t_start == window.t_start else None
    if mine is None or mine.t_end - window_start(window, pr.exp.profile.hold.warmup) < least:
        return False  # this level's streams are not written far enough yet
    return _plateau_served(pr, plateau.find_rejection_point(levels), allowance, halves, window.t_end, least)


def _plateau_served(pr: ProbeRun, rejection, allowance: float, halves: list, now: float, least: float) -> bool:
    """Has a saturated level held so far done what it can for the plateau? The verdict is settled, the
    plateau needs another deep level instead (unconfirmed), or the scatter between levels dominates:
    its half-width, recorded in `halves`, stopped narrowing over the last `least` seconds."""
    if _settled(pr, rejection, allowance) or not rejection.confirmed:
        return True
    halves.append((now, rejection.uncertainty or float("inf")))
    return not _narrowing(halves, least)


def _clean_decided(stats, *, exact_gauge: bool) -> bool:
    """Has a level below the knee settled whether it ran clean, as the no_preemption check reads
    it (`plateau.CLEAN_WAITING`)? It preempted, or its waiting mean's ~95% interval lies wholly
    below the threshold or wholly at or above it. Arrivals that bunch (an API server or a client
    that fell behind for a moment) queue a request or two for part of a lifetime; read over one
    lifetime such a level sat on the threshold (waiting 0.25-0.67 at N=23, clean predicted up to
    24, on the vLLM shadow) and the check had no clean level. So it is held on, up to the
    profile's hold, until its mean is decided.

    A sampled queue gauge reads low (SGLang publishes it after a prefill's admissions): the
    judgement reads such a level's waiting from the streams, which only exist once its requests
    ended. Live, a gauge that read no queue decides clean (`plateau.queue_seen`), one whose low
    reading already reaches the threshold decides waiting; in between the level is held to its
    longest."""
    if stats.preemptions:
        return True
    if not math.isfinite(stats.waiting_mean):
        return True  # no queue gauge: nothing more to read
    if not exact_gauge and not plateau.queue_seen(stats):
        return True
    if stats.waiting_se is None:
        return False
    half = plateau.Z95 * stats.waiting_se
    if stats.waiting_mean - half >= plateau.CLEAN_WAITING:
        return True
    return exact_gauge and stats.waiting_mean + half < plateau.CLEAN_WAITING


def _narrowing(halves: list[tuple[float, float]], span: float) -> bool:
    """Did the plateau's half-width shrink by NARROWING over the last `span` seconds of holding?"""
    now, half = halves[-1]
    before = [h for t, h in halves if t <= now - span]
    return not before or half < (1 - NARROWING) * before[-1]


NARROWING = 0.05


def _sum_ramp(pr: ProbeRun, note: str | None) -> None:
    """Seconds and request lifetimes per level into the result, for the report."""
    ramp, lifetime = pr.result.ramp, pr.lifetime
    for w, jitter in zip(pr.windows, pr.jitters, strict=True):
        held = w.t_end - w.t_start
        warm = (w.t_steady - w.t_start) if w.t_steady is not None else pr.exp.profile.hold.warmup * held
        ramp["levels"].append({"users": w.users, "seconds": round(held, 2), "warmup_s": round(warm, 2),
                               "start_jitter_s": round(jitter, 2), "held_for_lag": w.held_for_lag,
                               "lifetimes": round(held / lifetime, 2) if lifetime else None})
    total = sum(x["seconds"] for x in ramp["levels"])
    ramp["seconds"] = round(total, 2)
    ramp["lifetimes"] = round(total / lifetime, 2) if lifetime else None
    ramp["note"] = note
    if note:
        pr.log(f"kvprobe: {pr.exp.name}: ramp: {note}")


def _plan_rejection(pr: ProbeRun, extra=None):
    """The plateau as the levels measured so far (and `extra`, a level still held) show it, to
    plan deep levels. A sampled gauge reads low except at full steps, so its highest reading
    stands in for running here."""
    levels = pr.result.levels + ([extra] if extra is not None else [])
    if not pr.dialect.RUNNING_GAUGE_EXACT:
        levels = [replace(lv, running_mean=lv.engine_running_max) for lv in levels]
    return plateau.find_rejection_point(levels)


def _pct(x) -> str:
    return "  —  " if x is None or x != x else f"{x:5.1%}"


def _mean(x) -> str:
    return "     —" if x is None or x != x else f"{x:6.2f}"


def _count(x) -> str:
    return "—" if x is None or x != x else f"{x:g}"
