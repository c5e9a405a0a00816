"""From a metric time series and request records to measurements: steady state per level, a
client-side count of running requests reconciled with the engine's gauge, and the drain/leak
check. The rejection point (the plateau over these levels) is `kvprobe.analysis.plateau`.

numpy only, no I/O. Inputs are the arrays of `kvprobe.observe.sampler.TimeSeries.arrays()` — keys `t`,
`ok`, `running`, `waiting`, `usage`, `preemptions` (a counter), optionally `waiting_capacity` and
`used_tokens`; a failed scrape is a NaN (or `ok` false) and is skipped, never fatal. A metric the
engine does not export stays absent (NaN, None), never zero. Records are
`kvprobe.load.records.Record` objects or dicts with `t_send`, `t_first`, `t_end` (and `kind`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvprobe.analysis.steady import window_start
from kvprobe.load.health import LAG_SATURATED_MS

MIN_SAMPLES = 3  # a level with fewer steady-state samples is flagged, not averaged
BATCHES = 8  # batch means per window for the standard error of a steady mean
RECONCILE_ABS, RECONCILE_REL = 1.0, 0.05  # client count below a sampled gauge's mean: max(1 request, 5%)
RECONCILE_OVER_ABS, RECONCILE_OVER_REL = 2.0, 0.10  # ... above its highest reading: max(2 requests, 10%)


@dataclass
class LevelWindow:
    users: int
    t_start: float
    t_end: float
    t_steady: float | None = None  # detected steady start (analysis.steady); None: the profile's warm-up share
    held_for_lag: bool = False  # held on while its load generator lagged (kvprobe.probe.hold.PastBurst)


@dataclass
class LevelStats:
    users: int
    running_mean: float  # the figure the rejection point uses, from `running_source`
    running_max: float
    waiting_mean: float
    waiting_max: float
    usage_mean: float  # NaN when the engine exports no usage gauge
    usage_max: float
    preemptions: float | None  # counter increase in the steady window; None: counter absent (not 0)
    preemption_rate_per_s: float | None
    samples: int  # usable samples in the steady part
    client_running_mean: float | None = None  # from the request records: admitted, not finished
    client_waiting_mean: float | None = None  # from the request records: sent, not yet admitted
    running_source: str = "engine"  # "engine" (its gauge) or "client" (the streams; see reconcile)
    waiting_capacity_mean: float | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    t_steady: float | None = None  # the detected steady start, when the ramp detected one (analysis.steady)
    too_few_samples: bool = False  # fewer than MIN_SAMPLES: reported, excluded from the rejection point
    running_se: float | None = None  # standard error of running_mean (batch means over the window)
    waiting_se: float | None = None  # ... and of waiting_mean (decides a clean level: kvprobe.probe.ramp)
    engine_running_mean: float | None = None  # the engine's running gauge, steady mean (NaN: absent)
    engine_running_max: float | None = None  # its highest reading: what a sampled gauge shows at a full step
    engine_waiting_mean: float | None = None  # the engine's queue gauge, steady mean (NaN: absent)
    client_running_se: float | None = None
    disagreement: float | None = None  # client − engine gauge mean, where the gauge is a sample
    disagrees: bool = False  # the client count lies outside what the sampled gauge allows (see reconcile)
    client_lag_p99_ms: float | None = None  # the load processes' loop lag over the steady window (analysis.client)
    client_cpu: float | None = None  # ... and the busiest one's CPU (cores)
    client_lag_limit_ms: float = LAG_SATURATED_MS  # the lag above which the client set the timing (lag_limit_ms)
    client_saturated: bool = False  # the load generator, not the engine, set this level's timing
    client_saturated_by: list[str] = field(default_factory=list)  # which load processes, when there are several
    # engine steps over the span `preemptions` was counted in: the span over the median inter-token
    # time of the streams decoded inside it (one token per running request per step); the unit the
    # ledger's preemption rate is in (per 1k steps). None: no records, or no stream to time a step by
    engine_steps: float | None = None


@dataclass
class DrainResult:
    drained: bool
    time_to_zero: float | None  # seconds after t_from until running, waiting and usage stayed at zero
    residual_usage: float | None  # at the end of the deadline (last usable sample)
    residual_running: float | None
    residual_waiting: float | None
    leaked_blocks_estimate: int | None  # residual usage x pool size (None without a pool size)
    samples: int = 0
    watched: float | None = None  # seconds from t_from to the last usable sample
    idle_report_seconds: float | None = None  # the engine republishes idle gauges this often (None: every step)
    covered: bool = True  # watched long enough for an idle engine to have republished its gauges

    @property
    def stale(self) -> bool:
        """Not drained, but the gauges may still hold the last busy report: the engine's idle report
        was not watched for. Neither a leak nor a drain can be read."""
        return not self.drained and not self.covered


# -- helpers ----------------------------------------------------------------------------------

FIELDS = ("running", "waiting", "usage", "preemptions", "waiting_capacity")


def _col(arrays: dict, name: str, n: int) -> np.ndarray:
    """A float column; a missing key reads as all-NaN (the engine has no such metric)."""
    value = arrays.get(name)
    if value is None:
        return np.full(n, np.nan)
    out = np.asarray(value, dtype=float).reshape(-1)
    return out if out.size == n else np.full(n, np.nan)


def _columns(arrays: dict, *, counter_lazy: bool = False) -> dict[str, np.ndarray]:
    t = np.asarray(arrays.get("t", ()), dtype=float).reshape(-1)
    n = t.size
    cols = {k: _col(arrays, k, n) for k in FIELDS}
    ok = arrays.get("ok")
    ok = np.ones(n, dtype=bool) if ok is None or np.size(ok) != n else np.asarray(ok, dtype=bool).reshape(-1)
    pre = cols["preemptions"]
    if counter_lazy:
        # A counter the engine creates at its first event (SGLang's retractions): absent from a
        # good scrape before it first appears means "none yet", so its first value counts in full.
        seen = np.flatnonzero(np.isfinite(pre))
        before = (np.arange(n) < (seen[0] if seen.size else n)) & ok
        cols["preemptions"] = np.where(before, 0.0, pre)
        cols["preemptions_absent"] = before
    else:
        cols["preemptions_absent"] = ok & ~np.isfinite(pre)
    # A failed scrape carries no values even if a stale number was kept in the sample.
    for k in FIELDS:
        cols[k] = np.where(ok, cols[k], np.nan)
    cols["t"] = t
    return cols


def _stat(x: np.ndarray, fn) -> float:
    x = x[np.isfinite(x)]
    return float(fn(x)) if x.size else float("nan")


def batch_se(values: np.ndarray) -> float | None:
    """Standard error of the mean of an autocorrelated series, by batch means (None: too short)."""
    x = values[np.isfinite(values)]
    k = min(BATCHES, x.size // 2)
    if k < 2:
        return None
    means = np.array([b.mean() for b in np.array_split(x, k)])
    return float(means.std(ddof=1) / np.sqrt(k))


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


def _spans(records, lead_steps: float):
    """(send, admitted, end) per request. The client cannot see admission; it happens
    `lead_steps` engine steps before the first token arrives, a step estimated from the request's
    own inter-token time — or, for a stream cut before its end (no usage), from the median of the
    others. A request with no first token was never seen running; one cut by a ramp-down or the
    end of the load keeps its first token (the locustfile records it on arrival) and counts as
    running until it was cut."""
    rows = []
    for r in records or ():
        if (_rec(r, "kind") or "request") != "request" or _rec(r, "t_send") is None:
            continue
        send, first, end = float(_rec(r, "t_send")), _rec(r, "t_first"), _rec(r, "t_end")
        end = float(end) if end is not None else np.inf
        n = _rec(r, "completion_tokens") or 0
        itl = (end - float(first)) / (n - 1) if first is not None and n > 1 and np.isfinite(end) else None
        rows.append((send, None if first is None else float(first), end, itl))
    known = [row[3] for row in rows if row[3] is not None]
    typical = float(np.median(known)) if known else 0.0
    sends, admitted, ends = [], [], []
    for send, first, end, itl in rows:
        admit = end if first is None else max(send, first - lead_steps * (typical if itl is None else itl))
        sends.append(send), admitted.append(admit), ends.append(end)
    return np.asarray(sends, dtype=float), np.asarray(admitted, dtype=float), np.asarray(ends, dtype=float)


def step_seconds(records, t0: float, t1: float) -> float | None:
    """One engine step as the streams show it: the median inter-token time of the requests whose
    decode ran inside [t0, t1] (a token per running request per step, sync or async). A stream a
    preemption paused has a longer mean; the median leaves those few out. None: no such stream."""
    itls = []
    for r in records or ():
        if (_rec(r, "kind") or "request") != "request":
            continue
        first, end, n = _rec(r, "t_first"), _rec(r, "t_end"), _rec(r, "completion_tokens") or 0
        if first is None or end is None or n < 2 or float(first) < t0 or float(end) > t1:
            continue
        itls.append((float(end) - float(first)) / (n - 1))
    itl = float(np.median(itls)) if itls else 0.0
    return itl if itl > 0 else None


@dataclass(frozen=True)
class ClientCounts:
    running: float  # time average of admitted (first token less the lead) and not finished
    waiting: float  # time average of sent and not yet admitted
    running_se: float | None  # batch means over BATCHES equal parts of the window


def _integral(starts: np.ndarray, stops: np.ndarray, t0: float, t1: float) -> float:
    """∫ over [t0, t1] of #(starts ≤ t) − #(stops ≤ t): the time the spans [start, stop) spend in
    the window, for spans that start before they stop (an unfinished one stops at +inf)."""
    return float(np.sum(t1 - np.clip(starts, t0, t1)) - np.sum(t1 - np.clip(stops, t0, t1)))


def client_side_means(records, t0: float, t1: float, *, lead_steps: float = 0.0) -> ClientCounts | None:
    """Running and waiting as the client sees them, averaged exactly over [t0, t1]: running =
    admitted (first token minus `lead_steps` steps) and not finished; waiting = sent and not yet
    admitted. None for an empty window.

    Exact, not counted at instants: an engine at a token cap runs in lock-step with its step
    clock, and counting on a fixed grid (it was every 50 ms, about nine steps) aliases with it — on
    the emulated SGLang the same run read 20.93-21.52 on the grid and 20.25-20.27 exactly (its
    rejection point 21.44 against a limit of 20)."""
    if not t1 > t0:
        return None
    sends, admitted, ends = _spans(records, lead_steps)
    if sends.size == 0:
        return ClientCounts(0.0, 0.0, None)
    span = t1 - t0
    edges = t0 + span * np.arange(BATCHES + 1) / BATCHES
    parts = np.array([_integral(admitted, ends, a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)])
    se = float((parts / (span / BATCHES)).std(ddof=1) / np.sqrt(BATCHES))
    return ClientCounts(float(parts.sum() / span), _integral(sends, admitted, t0, t1) / span, se)


# -- per level --------------------------------------------------------------------------------


def level_stats(series_arrays: dict, windows: list[LevelWindow], *, warmup_fraction: float = 0.3,
                records=None, min_samples: int = MIN_SAMPLES, lead_steps: float = 0.0,
                counter_lazy: bool = False) -> list[LevelStats]:
    """Steady-state statistics of each level: the first `warmup_fraction` of its window is skipped.

    `counter_lazy`: the preemption counter is created at the first preemption (a dialect fact), so
    a good scrape without it reads as none so far. Either way a level on which the counter was
    never seen has `preemptions` None — absent, not zero."""
    cols = _columns(series_arrays, counter_lazy=counter_lazy)
    t = cols["t"]
    out = []
    for w in windows:
        start = window_start(w, warmup_fraction)
        sel = (t >= start) & (t <= w.t_end)
        running, waiting, usage = cols["running"][sel], cols["waiting"][sel], cols["usage"][sel]
        usable = int(np.sum(np.isfinite(running) | np.isfinite(waiting)))
        pre = cols["preemptions"][sel]
        seen = bool(np.isfinite(pre).any()) and not bool(cols["preemptions_absent"][sel].all())
        preempt = counter_increase(pre) if seen else None
        ts = t[sel][np.isfinite(pre)]
        span = float(ts[-1] - ts[0]) if ts.size >= 2 else 0.0
        client = client_waiting = client_se = steps = None
        if records is not None:
            step = step_seconds(records, start, w.t_end)
            steps = span / step if step and span > 0 and preempt is not None else None
            counts = client_side_means(records, start, w.t_end, lead_steps=lead_steps)
            if counts is not None:
                client, client_waiting, client_se = counts.running, counts.waiting, counts.running_se
        wcap = _stat(cols["waiting_capacity"][sel], np.mean)
        engine = _stat(running, np.mean)
        out.append(LevelStats(
            users=int(w.users),
            running_mean=engine, running_max=_stat(running, np.max),
            waiting_mean=_stat(waiting, np.mean), waiting_max=_stat(waiting, np.max),
            usage_mean=_stat(usage, np.mean), usage_max=_stat(usage, np.max),
            preemptions=preempt,
            preemption_rate_per_s=None if preempt is None else (preempt / span if span > 0 else 0.0),
            samples=usable, client_running_mean=client, client_waiting_mean=client_waiting,
            waiting_capacity_mean=None if np.isnan(wcap) else wcap,
            t_start=w.t_start, t_end=w.t_end, t_steady=w.t_steady, too_few_samples=usable < min_samples,
            running_se=batch_se(running), waiting_se=batch_se(waiting), engine_running_mean=engine,
            engine_waiting_mean=_stat(waiting, np.mean),
            engine_running_max=_stat(running, np.max), client_running_se=client_se, engine_steps=steps,
        ))
    return out


def reconcile(levels: list[LevelStats], *, gauge_exact: bool, metrics_ok: bool) -> list[LevelStats]:
    """Choose each level's running figure and record where it came from.

    - An exact gauge (a count after every step: vLLM) is used as it is. The client count stays
      beside it for the record; it is not compared, because a client cannot see a preemption
      (a recomputed stream just pauses).
    - A sampled gauge (SGLang publishes at prefill batches — the count *before* the new requests
      — and every 40 decode steps) is biased low, so the streams measure running and the two are
      reconciled. Most samples read below the true count, so the gauge's mean is close to a
      lower bound: a client count below it by more than max(1, 5%) undercounts (as streams
      cut at the stop counted as waiting). A decode report reads the batch as it is, so a client
      count above the highest reading by more than max(2, 10%) counts requests the engine does
      not hold. Either is a disagreement: recorded on the level and reported, not resolved.
      The queue gauge is published at the same moments (after the prefill's admissions), so
      waiting comes from the streams too; the engine's figure stays in `engine_waiting_mean`.
    - No gauge (no /metrics, or the family vanished for this level): the streams, waiting too.
    """
    for lv in levels:
        if lv.client_running_mean is None:
            continue
        engine = lv.engine_running_mean
        if not metrics_ok or engine is None or not np.isfinite(engine):
            lv.running_mean, lv.running_se, lv.running_source = lv.client_running_mean, lv.client_running_se, "client"
            if lv.client_waiting_mean is not None and (not metrics_ok or not np.isfinite(lv.waiting_mean)):
                lv.waiting_mean = lv.client_waiting_mean
            lv.too_few_samples = False
        elif not gauge_exact:
            client, high = lv.client_running_mean, lv.engine_running_max
            below = max(RECONCILE_ABS, RECONCILE_REL * client)
            above = max(RECONCILE_OVER_ABS, RECONCILE_OVER_REL * client)
            lv.running_mean, lv.running_se, lv.running_source = client, lv.client_running_se, "client"
            lv.disagreement = client - engine
            lv.disagrees = not (engine - below <= client <= high + above)
            if lv.client_waiting_mean is not None:  # the queue gauge is sampled at the same moments
                lv.waiting_mean = lv.client_waiting_mean
    return levels


# -- after the load ---------------------------------------------------------------------------


# Seconds past an engine's idle report interval by which its idle report must have been scraped: the
# client's disconnects reach the engine, its next idle pass runs, the sampler reads the result.
IDLE_REPORT_SLACK = 5.0
SAMPLE_GAP = 1.0  # the last sample of a watch may fall this much short of its end


def drain_window(drain_seconds: float, idle_report_seconds: float | None) -> float:
    """How long the drain is watched after the load stops: the profile's `drain_seconds`, or, for an
    engine that republishes its gauges only every `idle_report_seconds` when idle (SGLang: 30 s), long
    enough for that report to come — a shorter window would read its last busy report as a leak."""
    if idle_report_seconds is None:
        return drain_seconds
    return max(drain_seconds, idle_report_seconds + IDLE_REPORT_SLACK)


def drain_check(series_arrays: dict, t_from: float, *, deadline_s: float, pool_units: int | None = None,
                usage_tolerance: float | None = None, idle_report_seconds: float | None = None) -> DrainResult:
    """With no load after `t_from`, running, waiting and usage must reach zero and stay there before
    `t_from + deadline_s`. Usage still above zero at the end is a leak of `usage x pool_units`
    blocks (vLLM) or tokens (SGLang) — when the samples reach past the engine's idle report
    (`idle_report_seconds` after the stop, plus slack); before that the gauges may be the last busy
    report's, and the result is `stale`."""
    cols = _columns(series_arrays)
    t = cols["t"]
    sel = (t >= t_from) & (t <= t_from + deadline_s)
    running, waiting, usage = cols["running"][sel], cols["waiting"][sel], cols["usage"][sel]
    ts = t[sel]
    have = np.isfinite(running) | np.isfinite(waiting) | np.isfinite(usage)
    ts, running, waiting, usage = ts[have], running[have], waiting[have], usage[have]
    if ts.size == 0:
        return DrainResult(False, None, None, None, None, None, samples=0, idle_report_seconds=idle_report_seconds,
                           covered=False)
    watched = float(ts[-1] - t_from)
    covered = idle_report_seconds is None or watched >= idle_report_seconds + IDLE_REPORT_SLACK - SAMPLE_GAP
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
                       samples=int(ts.size), watched=watched, idle_report_seconds=idle_report_seconds, covered=covered)
