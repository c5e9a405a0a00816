"""The levels as the judgement will read them, while the load still runs.

A sampled running gauge (SGLang publishes its count at prefill batches and every 40 decode steps)
reads low except at full steps, so the verdict counts running from the client's streams
(`levels.reconcile`). Live, a stream's own record is written only once it has ended, so a request
still running or waiting is missing from those and an instant read too late counts it out. Each
load process also writes, at every flush, the requests it has in flight (`records.IN_FLIGHT`):
merged with them (`with_in_flight`) the streams are whole up to that snapshot, half a second ago.
Without snapshots (a load process that writes none) a window is read up to `written_until`: the
last instant at which every request in the engine then has since ended and been written.
"""

from __future__ import annotations

import numpy as np

from kvprobe.analysis import levels as analysis
from kvprobe.analysis.steady import window_start
from kvprobe.load.records import FLUSH_SECONDS, IN_FLIGHT, Record


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


def with_in_flight(records) -> tuple[list, float | None]:
    """The request records with every request in flight at its process's latest snapshot added (no
    end: running, or waiting before its first token), and the instant up to which that view is whole:
    the earliest of the processes' latest snapshots. None (and `records` as they are) when a process
    that wrote requests wrote no snapshot."""
    latest: dict = {}
    for r in records:
        if r.kind == IN_FLIGHT and (r.worker not in latest or r.t > latest[r.worker].t):
            latest[r.worker] = r
    requests = [r for r in records if r.kind == "request"]
    if not latest or any(r.worker not in latest for r in requests):
        return list(records), None
    ended = {r.request_id for r in requests}
    view = list(requests)
    for snap in latest.values():
        for rid, sent, first in zip(snap.ids or (), snap.sends or (), snap.firsts or (), strict=True):
            if rid not in ended:
                view.append(Record(t_send=sent, t_first=first, request_id=rid, worker=snap.worker))
    return view, min(snap.t for snap in latest.values())


def streams_levels(arrays: dict, windows: list[analysis.LevelWindow], records, *, now: float, warmup_fraction: float,
                   lead_steps: float, counter_lazy: bool) -> list[analysis.LevelStats]:
    """Each level of `windows` read as far as the streams are whole (`with_in_flight`, or else
    `written_until`; a level whose steady part is not written yet is left out), with running and
    waiting from the streams, reconciled with the gauge as the judgement does (`levels.reconcile`, a
    sampled gauge)."""
    if not windows:
        return []
    records, whole_until = with_in_flight(records)
    cut = whole_until if whole_until is not None else written_until(records, now, since=windows[-1].t_start)
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
