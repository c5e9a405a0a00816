"""Where a level's steady state starts: detected from its own series, not a fixed share of the hold.

MSER-5 (White, 1997, "An effective truncation heuristic for bias reduction in simulation output";
the truncation rule of steady-state simulation practice): batch the series into means of five
samples and truncate the first d batches that minimise the squared standard error of what
remains, var(batches[d:]) / (k − d). A transient (running climbing to the plateau, a queue
filling, over-admitted requests being preempted) inflates the variance of every suffix that
keeps it, so the minimum falls just after it; a series steady from its first sample keeps d = 0.
Only the first half of the window may be truncated (the rule's own bound: past it the estimate
rests on too few batches).

numpy only, no I/O.
"""

from __future__ import annotations

import numpy as np

BATCH = 5  # samples per batch (MSER-5)
MIN_BATCHES = 4  # fewer and there is nothing to compare: no truncation is detected


def mser_truncation(values: np.ndarray) -> int:
    """The number of leading samples MSER-5 truncates (a multiple of BATCH; 0 when steady)."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    k = x.size // BATCH
    if k < MIN_BATCHES:
        return 0
    batches = x[: k * BATCH].reshape(k, BATCH).mean(axis=1)
    best_d, best = 0, float("inf")
    for d in range(k // 2 + 1):
        rest = batches[d:]
        score = float(rest.var()) / rest.size
        if score < best - 1e-12:  # ties keep the earliest start: no truncation without a transient
            best_d, best = d, score
    return best_d * BATCH


def detected_start(t: np.ndarray, columns: list[np.ndarray], t_start: float, t_end: float) -> float:
    """The steady start of the window [t_start, t_end]: the latest MSER-5 truncation among the
    columns (running and waiting settle at different moments; both must have)."""
    sel = (t >= t_start) & (t <= t_end)
    times = t[sel]
    if times.size == 0:
        return t_start
    cut = max(mser_truncation(col[sel]) for col in columns)
    return float(times[min(cut, times.size - 1)]) if cut else t_start


def fed_since(t: np.ndarray, running: np.ndarray, waiting: np.ndarray, t_start: float, t_end: float,
               least: float) -> float | None:
    """When the engine first held `least` requests (running + waiting) in [t_start, t_end], or None
    when it has not yet. A closed loop keeps nearly all its users' requests in the engine; before
    the load generator delivers them (spawning, a starved loop) the series is flat and MSER finds
    it steady — at the wrong figure."""
    sel = (t >= t_start) & (t <= t_end)
    held = np.nan_to_num(running[sel], nan=0.0) + np.nan_to_num(waiting[sel], nan=0.0)
    hit = np.flatnonzero(held >= least)
    return float(t[sel][hit[0]]) if hit.size else None


def window_start(window, warmup_fraction: float) -> float:
    """Where a level's steady figures start: its detected start when the ramp detected one,
    else the profile's fixed warm-up share of the window."""
    steady = getattr(window, "t_steady", None)
    if steady is not None:
        return steady
    return window.t_start + warmup_fraction * (window.t_end - window.t_start)
