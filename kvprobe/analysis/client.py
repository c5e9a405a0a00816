"""Was the load generator starved while a level was held? Per level, from the load processes' lag
records (`kvprobe.load.health`: the p99 oversleep of a 10 ms gevent sleep, and CPU, once a second).

A level whose steady window the client set the timing of says nothing about the engine: its
running, queue, usage and preemption figures are what a slow client let through. `starvation`
names those levels (and the run's own figure when the run as a whole saturated), so the verdict
leaves every check that reads the load's figures unjudged, with one reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvprobe.analysis.steady import window_start
from kvprobe.load.health import CPU_SATURATED, HEALTH_PERIOD, lag_limit_ms, median_lifetime, worker_health


@dataclass
class Starvation:
    """The load generator was the bottleneck: at which levels, and how badly."""

    levels: list[int]  # the levels whose steady window a saturated load process served
    lag_p99_ms: float | None  # the worst loop-lag p99 (median over a level's seconds) among them
    cpu: float | None  # the busiest load process's CPU (cores) among them
    reason: str  # e.g. "at N=22, 26: loop lag p99 up to 77.0 ms > 15 ms"
    saturated: bool = True  # read as a client health (kvprobe.analysis.diagnosis reads .saturated, .reason)


def mark_levels(levels, records, *, warmup_fraction: float) -> None:
    """Each level's client figures over its steady window (the part its figures are read from):
    `client_lag_p99_ms`, `client_cpu`, `client_saturated` (`client_saturated_by`: which of several load
    processes). A process starved a level when most of its seconds there were saturated: one
    second's spike (another process scheduled over it) does not decide a level of two or three
    seconds. The lag limit scales with the level's request lifetime (`lag_limit_ms`): a lag that
    distorts a 0.3 s request is noise beside a 12 s one. A level without lag records keeps None."""
    for lv in levels:
        limit, by_worker = _lag_by_worker(records, lv.t_start, window_start(lv, warmup_fraction), lv.t_end)
        if not by_worker:
            continue
        workers = [(worker_health(w, rs, lag_limit=limit), _mostly_saturated(rs, limit))
                   for w, rs in sorted(by_worker.items())]
        lv.client_lag_limit_ms = limit
        lv.client_lag_p99_ms = max(h.lag_p99_ms for h, _ in workers)
        lv.client_cpu = max(h.cpu for h, _ in workers)
        lv.client_saturated = any(bad for _, bad in workers)
        if len(workers) > 1:  # name the load processes that saturated
            lv.client_saturated_by = [h.name for h, bad in workers if bad]


def starved_so_far(records, t_start: float, t_steady: float, now: float) -> bool:
    """Could `mark_levels` read a level held from `t_start` (steady from `t_steady`) until `now`
    as starved? The ramp asks while it holds a level, to hold on past a burst rather than lose it.

    A load process writes its lag record once a HEALTH_PERIOD and the file gets it up to a flush
    later, so the judgement of a level ended `now` may read a second the ramp has not seen: each
    such second counts as lagged here. Ending on a 1-of-2 look, the unseen third second lagged
    and the judgement read 2 of 3 (the SGLang shadow, loop lag 37 ms against 25.6)."""
    limit, by_worker = _lag_by_worker(records, t_start, t_steady, now)
    return any(_mostly_saturated(rs, limit, unseen=int((now - max(r.t for r in rs)) / HEALTH_PERIOD))
               for rs in by_worker.values())


def _lag_by_worker(records, t_start: float, t_steady: float, t_end: float) -> tuple[float, dict[str, list]]:
    """The lag limit for the requests of [t_start, t_end] and each load process's lag records of
    its steady part [t_steady, t_end]."""
    by_worker: dict[str, list] = {}
    for r in records:
        if r.kind == "lag" and r.worker != "master" and r.t is not None and t_steady <= r.t <= t_end:
            by_worker.setdefault(r.worker or "?", []).append(r)
    return lag_limit_ms(median_lifetime(records, t_start, t_end)), by_worker


def _mostly_saturated(lag_records, lag_limit: float, *, unseen: int = 0) -> bool:
    bad = sum(1 for r in lag_records if (r.lag_ms or 0.0) > lag_limit or (r.cpu or 0.0) > CPU_SATURATED)
    return 2 * (bad + unseen) > len(lag_records) + unseen


def starvation(levels, client, *, judged=None) -> Starvation | None:
    """The levels a starved client served, or the whole run when its client health saturated and a
    level that counts has no lag figure of its own (too short to hold a lag record).

    `judged`: the users of the levels the verdict reads at saturation (the plateau's levels). A
    level below them starved alone — a burst on a shared machine while a few users ran — changes
    no figure a check is judged on. None: every level counts.
    The run's own health (a median over all its seconds: warm-ups and unjudged levels too) stands in
    only where a counted level cannot speak for itself: when each was marked healthy over its own
    steady window, the run's figure reads seconds no check is judged on (the SGLang shadow on a
    busy CI runner: N=11 and 13 healthy, the run's median 18.2 ms at a limit of 18.2).
    Returns None when the load generator kept up."""
    counted = [lv for lv in levels if judged is None or lv.users in judged]
    whole = client is not None and client.saturated and \
        (not counted or any(lv.client_lag_p99_ms is None for lv in counted))
    starved = [lv for lv in (levels if whole else counted) if lv.client_saturated]
    if starved:
        lag = max((lv.client_lag_p99_ms or 0.0) for lv in starved)
        cpu = max((lv.client_cpu or 0.0) for lv in starved)
        causes = []
        limit = min(lv.client_lag_limit_ms for lv in starved)
        if lag > limit:
            causes.append(f"loop lag p99 up to {lag:.1f} ms > {limit:.3g} ms")
        if cpu > CPU_SATURATED:
            causes.append(f"a load process used up to {cpu:.2f} cores (> {CPU_SATURATED:g})")
        where = "N=" + ", ".join(str(lv.users) for lv in starved)
        names = sorted({name for lv in starved for name in lv.client_saturated_by})
        if names:
            causes.append("saturated: " + ", ".join(names))
        causes = causes or [f"most seconds saturated (loop lag p99 up to {lag:.1f} ms, CPU up to {cpu:.2f} cores)"]
        return Starvation([lv.users for lv in starved], lag, cpu, f"at {where}: " + "; ".join(causes))
    if whole:
        return Starvation([lv.users for lv in levels], client.lag_p99_ms, client.cpu,
                          f"over the whole run: {client.reason}")
    return None
