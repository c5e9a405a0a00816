"""The levels as the judgement will read them, while the load still runs.

A sampled running gauge (SGLang publishes its count at prefill batches and every 40 decode steps)
reads low except at full steps, so the verdict counts running from the client's streams
(`levels.reconcile`). Live, a stream is written only once it has ended (and the load process has
flushed it), so a request still running or waiting is missing from the records and an instant
read too late counts it out. Each window is read up to `written_until`: the last instant at which
every request in the engine then has since ended and been written.
"""

from __future__ import annotations

import numpy as np

from kvprobe.analysis import levels as analysis
from kvprobe.analysis.steady import window_start
from kvprobe.load.records import FLUSH_SECONDS


def written_until(records, now: float, since: float) -> float:
    """`now` less the longest a request that ended after `since` took from its send to its end (its
    wait, admission and decode), less one flush of the records: any request sent before that instant
    has ended and is in `records` by now, unless it took longer than any seen (the deepest level's
    latency grows as it holds, and the read moves back with it)."""
    longest = 0.0
    for r in records:
        if r.kind != "request" or r.t_send is None or r.t_end is None or r.t_end < since:
            continue
        longest = max(longest, r.t_end - r.t_send)
    return now - longest - FLUSH_SECONDS


def streams_levels(arrays: dict, windows: list[analysis.LevelWindow], records, *, now: float, warmup_fraction: float,
                   lead_steps: float, counter_lazy: bool) -> list[analysis.LevelStats]:
    """Each level of `windows` read up to `written_until` (one whose steady part is not written yet is
    left out), with running and waiting from the streams, reconciled with the gauge as the judgement
    does (`levels.reconcile`, a sampled gauge)."""
    if not windows:
        return []
    cut = written_until(records, now, since=windows[-1].t_start)
    clipped = []
    for w in windows:
        end = min(w.t_end, cut)
        if end > window_start(w, warmup_fraction):
            clipped.append(analysis.LevelWindow(users=w.users, t_start=w.t_start, t_end=end, t_steady=w.t_steady))
    if not clipped:
        return []
    metrics_ok = bool(np.asarray(arrays["ok"]).any()) if len(arrays["ok"]) else False
    levels = analysis.level_stats(arrays, clipped, warmup_fraction=warmup_fraction, records=records,
                                  lead_steps=lead_steps, counter_lazy=counter_lazy)
    return analysis.reconcile(levels, gauge_exact=False, metrics_ok=metrics_ok)
