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
    client_running_mean: float | None = None  # from the request records: first token, not finished
    client_waiting_mean: float | None = None  # from the request records: sent, no first token yet
    running_source: str = "engine"  # "client" when the engine's gauge is not trusted (see use_client_counts)
    waiting_capacity_mean: float | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    too_few_samples: bool = False  # fewer than MIN_SAMPLES: reported, excluded from the rejection point


@dataclass
class RejectionPoint:
    rejection_point: float | None  # the running plateau once saturated (median over the plateau levels)
    last_clean_users: int | None  # highest N with running ~ N, waiting below threshold, no preemption
    plateau: float | None  # mean running over the levels where waiting persists
    saturated_levels: list[int]  # every level with waiting at or above the threshold
    usage_at_rejection: float | None  # the usage gauge on the plateau, where admission stopped ("26% yet full")
    onset_users: int | None = None  # lowest N from which every higher level waits
    plateau_spread: float | None = None  # max - min of running over those levels (falling: stuck admission)
    transient_levels: list[int] = field(default_factory=list)  # waited once, but a higher level did not
    preempting_levels: list[int] = field(default_factory=list)
    skipped_levels: list[int] = field(default_factory=list)  # too few samples
    levels_seen: list[int] = field(default_factory=list)  # every usable level, ascending
    follow: float | None = None  # fitted running/N below the knee (closed-loop duty cycle)


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


def _spans(records, lead_steps: float):
    """(send, admitted, end) per request. The client cannot see admission; it happens
    `lead_steps` engine steps before the first token arrives, a step estimated from the request's
    own inter-token time. A request with no first token was never seen running."""
    sends, admitted, ends = [], [], []
    for r in records or ():
        if (_rec(r, "kind") or "request") != "request" or _rec(r, "t_send") is None:
            continue
        send, first, end = float(_rec(r, "t_send")), _rec(r, "t_first"), _rec(r, "t_end")
        end = float(end) if end is not None else np.inf
        if first is None:
            admit = end
        else:
            n = _rec(r, "completion_tokens") or 0
            itl = (end - float(first)) / (n - 1) if n > 1 and np.isfinite(end) else 0.0
            admit = max(send, float(first) - lead_steps * itl)
        sends.append(send), admitted.append(admit), ends.append(end)
    return (np.sort(np.asarray(sends, dtype=float)), np.sort(np.asarray(admitted, dtype=float)),
            np.sort(np.asarray(ends, dtype=float)))


def client_side_counts(records, t0: float, t1: float, step: float, *, lead_steps: float = 0.0):
    """(running, waiting) as the client sees them on `time_grid(t0, t1, step)`: running = admitted
    (first token minus `lead_steps` steps) and not finished; waiting = sent and not yet admitted."""
    grid = time_grid(t0, t1, step)
    sends, admitted, ends = _spans(records, lead_steps)
    if grid.size == 0 or sends.size == 0:
        return np.zeros(grid.size), np.zeros(grid.size)
    n_sent = np.searchsorted(sends, grid, side="right")
    n_admitted = np.searchsorted(admitted, grid, side="right")
    n_done = np.searchsorted(ends, grid, side="right")
    return (n_admitted - n_done).astype(float), (n_sent - n_admitted).astype(float)


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
                records=None, min_samples: int = MIN_SAMPLES, lead_steps: float = 0.0) -> list[LevelStats]:
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
        client = client_waiting = None
        if records is not None:
            run, wait = client_side_counts(records, start, w.t_end, 0.05, lead_steps=lead_steps)
            client = float(run.mean()) if run.size else None
            client_waiting = float(wait.mean()) if wait.size else None
        wcap = _stat(cols["waiting_capacity"][sel], np.mean)
        out.append(LevelStats(
            users=int(w.users),
            running_mean=_stat(running, np.mean), running_max=_stat(running, np.max),
            waiting_mean=_stat(waiting, np.mean), waiting_max=_stat(waiting, np.max),
            usage_mean=_stat(usage, np.mean), usage_max=_stat(usage, np.max),
            preemptions=preempt, preemption_rate_per_s=preempt / span if span > 0 else 0.0,
            samples=usable, client_running_mean=client, client_waiting_mean=client_waiting,
            waiting_capacity_mean=None if np.isnan(wcap) else wcap,
            t_start=w.t_start, t_end=w.t_end, too_few_samples=usable < min_samples,
        ))
    return out


def use_client_counts(levels: list[LevelStats], *, waiting_too: bool) -> list[LevelStats]:
    """Replace the engine's running (and, without /metrics, waiting) by what the client saw.

    For engines whose running gauge is a sample taken at scheduler events rather than a count
    after every step (SGLang reports at prefill batches, before the new requests, and every 40
    decode steps), the streams are the better measurement of running; without /metrics they
    are all there is."""
    for lv in levels:
        if lv.client_running_mean is not None:
            lv.running_mean, lv.running_source = lv.client_running_mean, "client"
            lv.too_few_samples = lv.too_few_samples and not waiting_too
        if waiting_too and lv.client_waiting_mean is not None:
            lv.waiting_mean = lv.client_waiting_mean
    return levels


# -- the rejection point ----------------------------------------------------------------------


def fit_hinge(users: np.ndarray, running: np.ndarray) -> tuple[float, float, int, float, float]:
    """Least-squares fit of running = min(follow × N, plateau), levels sorted by N.

    Returns (follow, plateau, knee_index, sse_hinge, sse_line): levels [knee_index:] are on the
    plateau; `sse_line` is the error of a plain line through the origin (no plateau at all).
    Closed-loop clients never run at exactly N (each user spends part of its cycle between
    requests, and a request waits a step before it is scheduled), so `follow` is fitted, not 1.
    """
    n = users.size
    line = float(np.dot(users, running) / np.dot(users, users))
    sse_line = float(np.sum((running - line * users) ** 2))
    best = (line, float("inf"), n, sse_line)
    for k in range(1, n):
        lo_n, lo_r = users[:k], running[:k]
        follow = float(np.dot(lo_n, lo_r) / np.dot(lo_n, lo_n))
        plateau = float(running[k:].mean())
        sse = float(np.sum((lo_r - follow * lo_n) ** 2) + np.sum((running[k:] - plateau) ** 2))
        if sse < best[3]:
            best = (follow, plateau, k, sse)
    follow, plateau, knee, sse = best
    return follow, plateau, knee, sse, sse_line


def find_rejection_point(levels: list[LevelStats], *, waiting_threshold: float = 0.5,
                         min_gap: float = 1.0) -> RejectionPoint:
    """Where running stops following N: the plateau of a hinge fit over the levels.

    Mean waiting alone cannot tell saturation from the queueing every engine shows between steps
    (a request that arrives mid-step waits for the next one), so the levels are fitted with
    running = min(follow × N, plateau). The engine is saturated when the plateau sits at least
    `min_gap` requests below where the line would have gone at the highest level, and the
    plateau levels wait. The rejection point is the plateau; the usage gauge is read there.
    """
    usable = sorted((lv for lv in levels if not lv.too_few_samples and np.isfinite(lv.running_mean)),
                    key=lambda lv: lv.users)
    skipped = sorted(lv.users for lv in levels if lv not in usable)
    seen = [lv.users for lv in usable]
    preempting = [lv.users for lv in usable if lv.preemptions > 0]
    waits = [lv.users for lv in usable if np.isfinite(lv.waiting_mean) and lv.waiting_mean >= waiting_threshold]
    if len(usable) < 2:
        return RejectionPoint(None, None, None, [], None, preempting_levels=preempting,
                              skipped_levels=skipped, levels_seen=seen)
    users = np.array([lv.users for lv in usable], dtype=float)
    running = np.array([lv.running_mean for lv in usable], dtype=float)
    follow, plateau, knee, _sse, _sse_line = fit_hinge(users, running)
    # A level at the knee fits the line and the plateau equally well, and a level where nothing
    # waits is not saturated whatever its running count: neither starts the plateau.
    while knee < len(usable) and (follow * users[knee] - running[knee] < min_gap / 2
                                  or not usable[knee].waiting_mean >= waiting_threshold):
        knee += 1
    on_plateau = usable[knee:]
    shortfall = follow * users[knee:] - running[knee:]
    waiting_levels = [lv for lv in on_plateau if np.isfinite(lv.waiting_mean) and lv.waiting_mean >= waiting_threshold]
    if not on_plateau or shortfall.max() < min_gap or len(waiting_levels) * 2 < len(on_plateau):
        clean = [lv.users for lv in usable if lv.preemptions == 0]
        return RejectionPoint(None, max(clean) if clean else None, None, [], None,
                              transient_levels=waits, preempting_levels=preempting, skipped_levels=skipped,
                              levels_seen=seen, follow=follow)
    plateau_running = np.array([lv.running_mean for lv in on_plateau])
    usage = np.array([lv.usage_mean for lv in on_plateau], dtype=float)
    usage = usage[np.isfinite(usage)]
    clean = [lv.users for lv in usable[:knee] if lv.preemptions == 0]
    last_clean = max(clean) if clean else None
    return RejectionPoint(
        rejection_point=float(np.median(plateau_running)),
        last_clean_users=last_clean,
        plateau=float(plateau_running.mean()),
        saturated_levels=[lv.users for lv in on_plateau],
        usage_at_rejection=float(np.median(usage)) if usage.size else None,
        onset_users=on_plateau[0].users,
        plateau_spread=float(plateau_running.max() - plateau_running.min()),
        transient_levels=[u for u in waits if u < on_plateau[0].users],
        preempting_levels=preempting,
        skipped_levels=skipped,
        levels_seen=seen,
        follow=follow,
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
