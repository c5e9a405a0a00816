"""analysis.py on synthetic time series whose answers are known by construction."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvprobe.analysis.levels import (
    IDLE_REPORT_SLACK,
    ClientCounts,
    LevelWindow,
    client_side_means,
    counter_increase,
    drain_check,
    drain_window,
    level_stats,
)
from kvprobe.analysis.plateau import find_rejection_point

HZ = 10
HOLD = 3.0
LIMIT = 20
POOL = 200  # usable blocks
BLOCKS_PER_REQUEST = 10


def ramp_series(levels, *, limit=LIMIT, noise=0.0, seed=0, preempt_per_s=0.0, usage_per_request=None):
    """A closed-loop ramp: running = min(N, limit), waiting = N - running, per level of HOLD seconds.

    The first 20% of every level is a transient (waiting spikes while the step is taken) that
    the warm-up must discard. Preemptions grow at `preempt_per_s` on levels above the limit.
    """
    rng = np.random.default_rng(seed)
    usage_per_request = usage_per_request or BLOCKS_PER_REQUEST / POOL
    t, running, waiting, usage, preempt, windows = [], [], [], [], [], []
    counter, now = 0.0, 100.0
    for n in levels:
        ts = now + np.arange(int(HOLD * HZ)) / HZ
        r = np.full(ts.size, float(min(n, limit)))
        w = np.full(ts.size, float(max(n - limit, 0)))
        transient = ts < now + 0.2 * HOLD
        w[transient] += 5.0
        r = r + noise * rng.standard_normal(ts.size)
        w = np.clip(w + noise * rng.standard_normal(ts.size), 0, None)
        c = counter + (preempt_per_s * (ts - now) if n > limit else 0 * ts)
        counter = float(c[-1]) + (preempt_per_s / HZ if n > limit else 0)
        t.append(ts), running.append(r), waiting.append(w), usage.append(r * usage_per_request), preempt.append(c)
        windows.append(LevelWindow(users=n, t_start=float(ts[0]), t_end=float(ts[-1])))
        now = float(ts[-1]) + 1 / HZ
    arrays = {k: np.concatenate(v) for k, v in
              (("t", t), ("running", running), ("waiting", waiting), ("usage", usage), ("preemptions", preempt))}
    arrays["ok"] = np.ones(arrays["t"].size, dtype=bool)
    return arrays, windows


LEVELS = [4, 8, 12, 16, 18, 19, 20, 21, 22, 24, 28]


def test_a_clean_ramp_plateaus_at_the_limit():
    arrays, windows = ramp_series(LEVELS)
    stats = level_stats(arrays, windows, warmup_fraction=0.3)
    assert [s.users for s in stats] == LEVELS
    assert all(s.samples >= 20 and not s.too_few_samples for s in stats)
    by_users = {s.users: s for s in stats}
    assert by_users[16].running_mean == pytest.approx(16) and by_users[16].waiting_mean == pytest.approx(0)
    assert by_users[28].running_mean == pytest.approx(20) and by_users[28].waiting_mean == pytest.approx(8)
    rp = find_rejection_point(stats)
    assert rp.rejection_point == pytest.approx(20) and rp.plateau == pytest.approx(20)
    assert rp.last_clean_users == 20 and rp.onset_users == 21
    assert rp.saturated_levels == [21, 22, 24, 28] and rp.transient_levels == []
    assert rp.plateau_spread == pytest.approx(0)
    assert rp.usage_at_rejection == pytest.approx(20 * BLOCKS_PER_REQUEST / POOL)
    assert rp.levels_seen == LEVELS


def test_without_warmup_the_transient_would_count():
    arrays, windows = ramp_series([8])
    assert level_stats(arrays, windows, warmup_fraction=0.3)[0].waiting_mean == pytest.approx(0)
    assert level_stats(arrays, windows, warmup_fraction=0.0)[0].waiting_mean > 0.5


def test_noise_does_not_move_the_answer():
    arrays, windows = ramp_series(LEVELS, noise=0.15, seed=3)
    rp = find_rejection_point(level_stats(arrays, windows))
    assert rp.rejection_point == pytest.approx(20, abs=0.2)
    assert rp.last_clean_users == 20 and rp.onset_users == 21


def test_the_usage_gauge_reads_low_when_admission_stops():
    """'26% yet full': the gauge at the onset is what it reads, not 100%."""
    arrays, windows = ramp_series(LEVELS, usage_per_request=0.013)
    rp = find_rejection_point(level_stats(arrays, windows))
    assert rp.usage_at_rejection == pytest.approx(0.26)


def test_preemptions_are_counted_from_the_counter():
    arrays, windows = ramp_series(LEVELS, preempt_per_s=2.0)
    stats = {s.users: s for s in level_stats(arrays, windows, warmup_fraction=0.3)}
    assert stats[20].preemptions == 0 and stats[20].preemption_rate_per_s == 0
    assert stats[24].preemption_rate_per_s == pytest.approx(2.0)
    steady = windows[LEVELS.index(24)]
    assert stats[24].preemptions == pytest.approx(2.0 * 0.7 * (steady.t_end - steady.t_start), rel=0.06)
    rp = find_rejection_point(list(stats.values()))
    assert rp.preempting_levels == [21, 22, 24, 28] and rp.last_clean_users == 20


def test_engine_steps_are_timed_by_the_streams_median_inter_token_time():
    # 24 users on a 20-slot engine: 2 preemptions a second; streams of 65 tokens, one a step of 25 ms
    arrays, windows = ramp_series([24], preempt_per_s=2.0)
    w = windows[0]
    steady = w.t_start + 0.3 * (w.t_end - w.t_start)
    records = [{"t_send": t - 0.5, "t_first": t, "t_end": t + 64 * 0.025, "completion_tokens": 65}
               for t in np.arange(steady, w.t_end - 2, 0.2)]
    records.append({"t_send": steady, "t_first": steady, "t_end": steady + 64 * 0.2, "completion_tokens": 65})
    (stats,) = level_stats(arrays, windows, records=records)  # a paused (preempted) stream: left out by the median
    span = (w.t_end - steady)
    assert stats.engine_steps == pytest.approx(span / 0.025, rel=0.02)
    # per 1k steps: 2 a second at 40 steps a second is 50 per 1k steps, whatever the hold
    assert 1000 * stats.preemptions / stats.engine_steps == pytest.approx(50, rel=0.06)
    assert level_stats(arrays, windows)[0].engine_steps is None  # no streams: no step to time


def test_a_counter_restart_counts_from_zero():
    assert counter_increase(np.array([10, 12, np.nan, 15, 1, 3])) == pytest.approx(5 + 1 + 2)
    assert counter_increase(np.array([np.nan, 7.0])) == 0


def test_preemption_blocks_a_clean_level():
    arrays, windows = ramp_series([10, 15, 20, 25])
    i = np.flatnonzero((arrays["t"] > windows[1].t_start + 2) & (arrays["t"] <= windows[1].t_end))
    arrays["preemptions"][i[0]:] += 1  # one preemption at N=15 and the counter stays up
    rp = find_rejection_point(level_stats(arrays, windows))
    assert rp.preempting_levels == [15] and rp.last_clean_users == 20


def test_nan_gaps_and_starved_levels_do_not_crash():
    arrays, windows = ramp_series(LEVELS, seed=1)
    rng = np.random.default_rng(7)
    gaps = rng.random(arrays["t"].size) < 0.3
    for key in ("running", "waiting", "usage", "preemptions"):
        arrays[key][gaps] = np.nan
    starved = windows[LEVELS.index(18)]
    inside = (arrays["t"] >= starved.t_start) & (arrays["t"] <= starved.t_end)
    arrays["ok"][inside] = False  # every scrape of this level failed (values kept but not trusted)
    stats = level_stats(arrays, windows)
    s18 = next(s for s in stats if s.users == 18)
    assert s18.too_few_samples and s18.samples == 0 and np.isnan(s18.running_mean)
    rp = find_rejection_point(stats)
    assert rp.skipped_levels == [18] and 18 not in rp.levels_seen
    assert rp.rejection_point == pytest.approx(20) and rp.last_clean_users == 20


def test_missing_metrics_read_as_nan():
    arrays, windows = ramp_series([4, 30])
    del arrays["usage"], arrays["preemptions"]
    stats = level_stats(arrays, windows)
    # absent is not zero: no counter, no preemption count
    assert np.isnan(stats[1].usage_mean) and stats[1].preemptions is None and stats[1].preemption_rate_per_s is None
    rp = find_rejection_point(stats)
    assert rp.rejection_point == pytest.approx(20) and rp.usage_at_rejection is None


def test_transient_waiting_below_the_onset_is_not_the_rejection_point():
    arrays, windows = ramp_series(LEVELS)
    burst = windows[LEVELS.index(12)]
    inside = (arrays["t"] >= burst.t_start) & (arrays["t"] <= burst.t_end)
    arrays["waiting"][inside] = 2.0
    rp = find_rejection_point(level_stats(arrays, windows))
    assert rp.transient_levels == [12] and rp.onset_users == 21
    assert rp.rejection_point == pytest.approx(20)


def test_closed_loop_duty_cycle_and_queueing_between_steps_are_not_saturation():
    """Real closed loops run at ~0.93 N and show a little waiting between steps at every level."""
    users = [4, 7, 11, 14, 18, 19, 20, 21, 22, 23, 25, 27]
    running = [3.76, 6.62, 10.52, 13.29, 16.45, 17.24, 18.33, 19.57, 20.05, 20.10, 20.19, 19.71]
    waiting = [0.14, 0.19, 0.29, 0.19, 0.75, 0.76, 1.14, 0.62, 1.33, 2.19, 4.10, 6.05]
    stats = [SimpleNamespace(users=u, running_mean=r, waiting_mean=w, waiting_max=w, usage_mean=0.9,
                             preemptions=0 if u <= 20 else 5, too_few_samples=False, running_se=None)
             for u, r, w in zip(users, running, waiting, strict=True)]
    rp = find_rejection_point(stats)
    assert 19.7 <= rp.rejection_point <= 20.3
    # N=20 waits 1.14 where step queueing alone (0.027/user, from N <= 14) explains 0.53: it is not
    # clean, and N=21 preempts (a level that waits is never reported clean)
    assert rp.onset_users == 22 and rp.last_clean_users == 19 and rp.transient_levels == [20]
    assert rp.step_waiting_per_user == pytest.approx(0.0266, abs=0.001)
    assert 0.9 < rp.follow < 0.96


def test_no_saturation_means_no_rejection_point():
    arrays, windows = ramp_series([4, 8, 12])
    rp = find_rejection_point(level_stats(arrays, windows))
    assert rp.rejection_point is None and rp.plateau is None and rp.onset_users is None
    assert rp.last_clean_users == 12 and rp.saturated_levels == []


def test_a_falling_plateau_shows_as_spread():
    """Stuck admission: once full, running collapses at higher levels."""
    arrays, windows = ramp_series([16, 24, 28])
    last = windows[2]
    inside = (arrays["t"] >= last.t_start) & (arrays["t"] <= last.t_end)
    arrays["running"][inside] = 2.0
    rp = find_rejection_point(level_stats(arrays, windows))
    # both levels wait deeply, so both weigh fully: the estimate halves and the spread shows the fall
    assert rp.rejection_point == pytest.approx(11.0) and rp.plateau_spread == pytest.approx(18.0)
    assert rp.onset_users == 24 and rp.scale > 10  # the two levels disagree far beyond their errors


def drain_series(*, until_zero: float, residual_usage: float, gaps=False, seconds=10.0):
    t = 200.0 + np.arange(int(seconds * HZ)) / HZ
    falling = np.clip(1 - (t - 200.0) / until_zero, 0, None)
    arrays = {
        "t": t,
        "running": np.round(20 * falling),
        "waiting": np.round(5 * falling),
        "usage": np.maximum(0.5 * falling, residual_usage),
        "ok": np.ones(t.size, dtype=bool),
    }
    if gaps:
        for key in ("running", "waiting", "usage"):
            arrays[key][::3] = np.nan
    return arrays


def test_a_clean_drain():
    res = drain_check(drain_series(until_zero=2.0, residual_usage=0.0), 200.0, deadline_s=8.0, pool_units=POOL)
    assert res.drained and res.time_to_zero == pytest.approx(2.0, abs=0.11)
    assert res.residual_usage == 0 and res.residual_running == 0 and res.leaked_blocks_estimate == 0


def test_a_leak_never_drains():
    res = drain_check(drain_series(until_zero=2.0, residual_usage=0.05), 200.0, deadline_s=8.0, pool_units=POOL)
    assert not res.drained and res.time_to_zero is None
    assert res.residual_usage == pytest.approx(0.05) and res.residual_running == 0
    assert res.leaked_blocks_estimate == 10


def test_a_drain_slower_than_the_deadline_fails():
    res = drain_check(drain_series(until_zero=6.0, residual_usage=0.0), 200.0, deadline_s=3.0, pool_units=POOL)
    assert not res.drained and res.residual_running > 0


def test_drain_with_nan_gaps():
    res = drain_check(drain_series(until_zero=2.0, residual_usage=0.0, gaps=True), 200.0, deadline_s=8.0)
    assert res.drained and res.time_to_zero == pytest.approx(2.0, abs=0.21)
    assert res.leaked_blocks_estimate is None  # no pool size given


def test_drain_without_any_sample():
    empty = {"t": np.empty(0), "running": np.empty(0), "waiting": np.empty(0), "usage": np.empty(0)}
    res = drain_check(empty, 0.0, deadline_s=5.0, pool_units=POOL)
    assert not res.drained and res.samples == 0 and res.residual_usage is None


def test_the_streams_count_running_from_first_token_to_end_and_waiting_before_it():
    records = [
        {"kind": "request", "t_send": 0.0, "t_first": 0.5, "t_end": 2.0},
        SimpleNamespace(kind="request", t_send=0.0, t_first=1.0, t_end=None),  # still streaming
        {"kind": "request", "t_send": 0.0, "t_first": None, "t_end": 3.0},  # failed before a token
        {"kind": "lag", "t": 1.0, "lag_ms": 3.0},
        {"t_send": 1.0, "t_first": 1.5, "t_end": 1.7},  # kind defaults to request
    ]
    counts = client_side_means(records, 0.0, 3.0)
    assert counts.running == pytest.approx((1.5 + 2.0 + 0.2) / 3)  # the failed one never ran
    assert counts.waiting == pytest.approx((0.5 + 1.0 + 3.0 + 0.5) / 3)  # ... but waited until it failed
    assert client_side_means([], 0.0, 1.0) == ClientCounts(0.0, 0.0, None)


def test_level_stats_adds_the_client_side_estimate():
    arrays, windows = ramp_series([5])
    w = windows[0]
    records = [{"t_send": w.t_start, "t_first": w.t_start + 0.1, "t_end": None} for _ in range(5)]
    (stats,) = level_stats(arrays, windows, records=records)
    assert stats.client_running_mean == pytest.approx(5)


def test_a_level_where_nothing_waits_never_starts_the_plateau():
    """A dip in running just below the limit (no one waiting) must not pull the plateau down."""
    users = [4, 7, 11, 14, 18, 19, 20, 21, 22, 24, 26]
    running = [3.8, 6.7, 10.5, 13.8, 17.5, 18.41, 18.0, 19.9, 20.2, 20.3, 20.1]
    waiting = [0, 0, 0, 0, 0, 0, 0, 0.7, 1.8, 2.0, 3.6]
    stats = [SimpleNamespace(users=u, running_mean=r, waiting_mean=w, waiting_max=w, usage_mean=0.8, preemptions=0,
                             too_few_samples=False, running_se=None)
             for u, r, w in zip(users, running, waiting, strict=True)]
    rp = find_rejection_point(stats)
    assert 19.9 <= rp.rejection_point <= 20.3
    assert 20 not in rp.saturated_levels and 19 not in rp.saturated_levels


def stale_series(*, report_at: float | None, residual_usage: float = 0.0, seconds: float = 40.0):
    """SGLang after the load: running 0 at once, usage holding the last busy report (0.31) until the
    idle report at `report_at` s (None: none in the series), then `residual_usage`."""
    t = 200.0 + np.arange(int(seconds * HZ)) / HZ
    usage = np.full(t.size, 0.31)
    if report_at is not None:
        usage[t >= 200.0 + report_at] = residual_usage
    return {"t": t, "running": np.zeros(t.size), "waiting": np.zeros(t.size), "usage": usage,
            "ok": np.ones(t.size, dtype=bool)}


def test_an_idle_report_after_the_drain_window_is_waited_for():
    window = drain_window(10.0, 30.0)
    assert window == 30.0 + IDLE_REPORT_SLACK and drain_window(10.0, None) == 10.0 and drain_window(60.0, 30.0) == 60
    late = stale_series(report_at=29.5)
    res = drain_check(late, 200.0, deadline_s=window, pool_units=POOL, idle_report_seconds=30.0)
    assert res.drained and res.covered and res.time_to_zero == pytest.approx(29.5, abs=0.11)
    # watched only the profile's 10 s: the last busy report is still on the gauge, no verdict either way
    short = drain_check(late, 200.0, deadline_s=10.0, pool_units=POOL, idle_report_seconds=30.0)
    assert short.stale and not short.drained and short.watched == pytest.approx(10.0, abs=0.11)
    # the engine's interval unknown (vLLM: every step), the same reading is a leak
    assert not drain_check(late, 200.0, deadline_s=10.0, pool_units=POOL).stale


def test_a_leak_the_idle_report_shows_is_a_leak():
    leak = stale_series(report_at=29.5, residual_usage=0.05)
    res = drain_check(leak, 200.0, deadline_s=drain_window(10.0, 30.0), pool_units=POOL, idle_report_seconds=30.0)
    assert not res.drained and not res.stale and res.leaked_blocks_estimate == 10
