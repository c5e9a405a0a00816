"""From a metric time series and request records to measurements: steady state per level, the
rejection point, the drain/leak check, and a client-side count of running requests.

numpy only, no I/O. Inputs are the arrays of `kvprobe.observe.TimeSeries.arrays()` — keys `t`,
`ok`, `running`, `waiting`, `usage`, `preemptions` (a counter), optionally `waiting_capacity` and
`used_tokens`; a failed scrape is a NaN (or `ok` false) and is skipped, never fatal. Records are
`kvprobe.load.records.Record` objects or dicts with `t_send`, `t_first`, `t_end` (and `kind`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MIN_SAMPLES = 3  # a level with fewer steady-state samples is flagged, not averaged


@dataclass
class LevelWindow:
    users: int
    t_start: float
    t_end: float


@dataclass
class LevelStats:
    users: int
    running_mean: float
    running_max: float
    waiting_mean: float
    waiting_max: float
    usage_mean: float
    usage_max: float
    preemptions: float  # counter increase inside the steady part of the window
    preemption_rate_per_s: float
    samples: int  # usable samples in the steady part
    client_running_mean: float | None = None
    waiting_capacity_mean: float | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    too_few_samples: bool = False  # fewer than MIN_SAMPLES: reported, excluded from the rejection point


@dataclass
class RejectionPoint:
    rejection_point: float | None  # the running plateau where waiting persists (median over those levels)
    last_clean_users: int | None  # highest N with running ~ N, waiting below threshold, no preemption
    plateau: float | None  # mean running over the levels where waiting persists
    saturated_levels: list[int]  # every level with waiting at or above the threshold
    usage_at_rejection: float | None  # the usage gauge where waiting first persisted ("26% yet full")
    onset_users: int | None = None  # lowest N from which every higher level waits
    plateau_spread: float | None = None  # max - min of running over those levels (falling: stuck admission)
    transient_levels: list[int] = field(default_factory=list)  # waited once, but a higher level did not
    preempting_levels: list[int] = field(default_factory=list)
    skipped_levels: list[int] = field(default_factory=list)  # too few samples
    levels_seen: list[int] = field(default_factory=list)  # every usable level, ascending


@dataclass
class DrainResult:
    drained: bool
    time_to_zero: float | None  # seconds after t_from until running, waiting and usage stayed at zero
    residual_usage: float | None  # at the end of the deadline (last usable sample)
    residual_running: float | None
    residual_waiting: float | None
    leaked_blocks_estimate: int | None  # residual usage x pool size (None without a pool size)
    samples: int = 0


# -- helpers ----------------------------------------------------------------------------------


def _col(arrays: dict, name: str, n: int) -> np.ndarray:
    """A float column; a missing key reads as all-NaN (the engine has no such metric)."""
    value = arrays.get(name)
    if value is None:
        return np.full(n, np.nan)
    out = np.asarray(value, dtype=float).reshape(-1)
    return out if out.size == n else np.full(n, np.nan)


def _columns(arrays: dict) -> dict[str, np.ndarray]:
    t = np.asarray(arrays.get("t", ()), dtype=float).reshape(-1)
    n = t.size
    cols = {k: _col(arrays, k, n) for k in ("running", "waiting", "usage", "preemptions", "waiting_capacity")}
    ok = arrays.get("ok")
    ok = np.ones(n, dtype=bool) if ok is None or np.size(ok) != n else np.asarray(ok, dtype=bool).reshape(-1)
    # A failed scrape carries no values even if a stale number was kept in the sample.
    for k in cols:
        cols[k] = np.where(ok, cols[k], np.nan)
    cols["t"] = t
    return cols


def _stat(x: np.ndarray, fn) -> float:
    x = x[np.isfinite(x)]
    return float(fn(x)) if x.size else float("nan")


def counter_increase(values: np.ndarray) -> float:
    """Increase of a counter over finite samples; a drop is a restart, counted from zero."""
    v = values[np.isfinite(values)]
    if v.size < 2:
        return 0.0
    d = np.diff(v)
    return float(np.sum(np.where(d >= 0, d, v[1:])))


def _rec(record, name: str):
    value = record.get(name) if isinstance(record, dict) else getattr(record, name, None)
    return None if value is None else value


def _request_spans(records) -> tuple[np.ndarray, np.ndarray]:
    """(t_first, t_end) of requests that received a first token; unfinished end at +inf."""
    firsts, ends = [], []
    for r in records or ():
        if (_rec(r, "kind") or "request") != "request":
            continue
        t_first = _rec(r, "t_first")
        if t_first is None or not np.isfinite(t_first):
            continue
        t_end = _rec(r, "t_end")
        firsts.append(float(t_first))
        ends.append(float(t_end) if t_end is not None and np.isfinite(t_end) else np.inf)
    return np.asarray(firsts, dtype=float), np.asarray(ends, dtype=float)


def time_grid(t0: float, t1: float, step: float) -> np.ndarray:
    """The times at which `client_side_running` counts: t0, t0+step, ... up to t1 inclusive."""
    if step <= 0 or t1 < t0:
        return np.empty(0)
    n = int(np.floor((t1 - t0) / step + 1e-9)) + 1
    return t0 + step * np.arange(n)


def client_side_running(records, t0: float, t1: float, step: float) -> np.ndarray:
    """Requests running as the client sees them, on `time_grid(t0, t1, step)`: first token
    received and not yet finished. Used when the engine exposes no /metrics."""
    grid = time_grid(t0, t1, step)
    firsts, ends = _request_spans(records)
    if grid.size == 0 or firsts.size == 0:
        return np.zeros(grid.size)
    started = np.searchsorted(np.sort(firsts), grid, side="right")
    finished = np.searchsorted(np.sort(ends), grid, side="right")
    return (started - finished).astype(float)


# -- per level --------------------------------------------------------------------------------


def level_stats(series_arrays: dict, windows: list[LevelWindow], *, warmup_fraction: float = 0.3,
                records=None, min_samples: int = MIN_SAMPLES) -> list[LevelStats]:
    """Steady-state statistics of each level: the first `warmup_fraction` of its window is skipped."""
    cols = _columns(series_arrays)
    t = cols["t"]
    out = []
    for w in windows:
        start = w.t_start + warmup_fraction * (w.t_end - w.t_start)
        sel = (t >= start) & (t <= w.t_end)
        running, waiting, usage = cols["running"][sel], cols["waiting"][sel], cols["usage"][sel]
        usable = int(np.sum(np.isfinite(running) | np.isfinite(waiting)))
        preempt = counter_increase(cols["preemptions"][sel])
        ts = t[sel][np.isfinite(cols["preemptions"][sel])]
        span = float(ts[-1] - ts[0]) if ts.size >= 2 else 0.0
        client = None
        if records is not None:
            step = float(np.median(np.diff(t))) if t.size >= 2 and np.all(np.isfinite(t)) else 0.1
            counts = client_side_running(records, start, w.t_end, max(step, 1e-3))
            client = float(counts.mean()) if counts.size else None
        wcap = _stat(cols["waiting_capacity"][sel], np.mean)
        out.append(LevelStats(
            users=int(w.users),
            running_mean=_stat(running, np.mean), running_max=_stat(running, np.max),
            waiting_mean=_stat(waiting, np.mean), waiting_max=_stat(waiting, np.max),
            usage_mean=_stat(usage, np.mean), usage_max=_stat(usage, np.max),
            preemptions=preempt, preemption_rate_per_s=preempt / span if span > 0 else 0.0,
            samples=usable, client_running_mean=client,
            waiting_capacity_mean=None if np.isnan(wcap) else wcap,
            t_start=w.t_start, t_end=w.t_end, too_few_samples=usable < min_samples,
        ))
    return out


# -- the rejection point ----------------------------------------------------------------------


def find_rejection_point(levels: list[LevelStats], *, waiting_threshold: float = 0.5,
                         running_tolerance: float = 0.5) -> RejectionPoint:
    """Where running stops following N and waiting persists.

    A level *waits* when its mean waiting is at least `waiting_threshold`. Waiting *persists* from
    the lowest N at which every higher usable level also waits (`onset_users`); a level that waited
    below that is transient (noise, a burst) and is listed, not used. The rejection point is the
    median running count over the persisting levels; the usage gauge is read at the onset.
    """
    usable = sorted((lv for lv in levels if not lv.too_few_samples and np.isfinite(lv.running_mean)),
                    key=lambda lv: lv.users)
    skipped = sorted(lv.users for lv in levels if lv not in usable)

    def waits(lv: LevelStats) -> bool:
        return bool(np.isfinite(lv.waiting_mean) and lv.waiting_mean >= waiting_threshold)

    saturated = [lv.users for lv in usable if waits(lv)]
    preempting = [lv.users for lv in usable if lv.preemptions > 0]
    clean = [lv.users for lv in usable
             if abs(lv.running_mean - lv.users) <= running_tolerance and not waits(lv) and lv.preemptions == 0]
    onset_index = None
    for i in range(len(usable) - 1, -1, -1):
        if not waits(usable[i]):
            break
        onset_index = i
    if onset_index is None:
        return RejectionPoint(None, max(clean) if clean else None, None, saturated, None,
                              transient_levels=saturated, preempting_levels=preempting, skipped_levels=skipped,
                              levels_seen=[lv.users for lv in usable])
    persisting = usable[onset_index:]
    running = np.array([lv.running_mean for lv in persisting])
    onset = persisting[0]
    return RejectionPoint(
        rejection_point=float(np.median(running)),
        last_clean_users=max(clean) if clean else None,
        plateau=float(running.mean()),
        saturated_levels=saturated,
        usage_at_rejection=None if np.isnan(onset.usage_mean) else float(onset.usage_mean),
        onset_users=onset.users,
        plateau_spread=float(running.max() - running.min()),
        transient_levels=[u for u in saturated if u < onset.users],
        preempting_levels=preempting,
        skipped_levels=skipped,
        levels_seen=[lv.users for lv in usable],
    )


# -- after the load ---------------------------------------------------------------------------


def drain_check(series_arrays: dict, t_from: float, *, deadline_s: float, pool_units: int | None = None,
                usage_tolerance: float | None = None) -> DrainResult:
    """With no load after `t_from`, running, waiting and usage must reach zero and stay there before
    `t_from + deadline_s`. Usage still above zero at the end is a leak of `usage x pool_units`
    blocks (vLLM) or tokens (SGLang)."""
    cols = _columns(series_arrays)
    t = cols["t"]
    sel = (t >= t_from) & (t <= t_from + deadline_s)
    running, waiting, usage = cols["running"][sel], cols["waiting"][sel], cols["usage"][sel]
    ts = t[sel]
    have = np.isfinite(running) | np.isfinite(waiting) | np.isfinite(usage)
    ts, running, waiting, usage = ts[have], running[have], waiting[have], usage[have]
    if ts.size == 0:
        return DrainResult(False, None, None, None, None, None, samples=0)
    tol = usage_tolerance if usage_tolerance is not None else (0.5 / pool_units if pool_units else 1e-6)
    # A metric the engine does not export (all NaN) does not block the verdict; a NaN gap does not count as zero.
    zero = np.ones(ts.size, dtype=bool)
    for values, limit in ((running, 0.5), (waiting, 0.5), (usage, tol)):
        if np.isfinite(values).any():
            zero &= np.isfinite(values) & (values < limit)
    # The first sample from which every later sample is zero.
    tail_zero = np.flip(np.cumprod(np.flip(zero))).astype(bool)
    drained = bool(tail_zero[-1])
    time_to_zero = float(ts[int(np.argmax(tail_zero))] - t_from) if drained else None

    def last(values):
        v = values[np.isfinite(values)]
        return float(v[-1]) if v.size else None

    residual_usage = last(usage)
    leaked = None
    if pool_units and residual_usage is not None:
        leaked = int(round(max(residual_usage, 0.0) * pool_units))
    return DrainResult(drained, time_to_zero, residual_usage, last(running), last(waiting), leaked,
                       samples=int(ts.size))
