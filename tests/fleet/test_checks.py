"""The fleet's checks and the sampler's combination, on figures made by hand."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvprobe.analysis.levels import LevelWindow
from kvprobe.observe.sampler import Sample
from kvprobe.targets.fleet.sampler import combine
from kvprobe.verdict import fleet as checks

TOL = SimpleNamespace(rejection_point=1.0, rejection_point_relative=0.05)


def level(users, inflights, predicted_imbalance=0.0, predicted_running=None, predicted_waiting=0.0, sd=0.0):
    reps = [{"running": x, "waiting": 0.0, "usage": 0.5, "inflight": x, "samples": 20,
             "usage_when_waiting": None, "waiting_fraction": 0.0} for x in inflights]
    return {"users": users, "replicas": reps, "running": sum(inflights),
            "imbalance": max(inflights) - min(inflights),
            "predicted": {"imbalance": predicted_imbalance, "fleet_running": predicted_running or sum(inflights),
                          "fleet_waiting": predicted_waiting, "fleet_running_sd": sd}}


def test_even_split_imbalance_is_judged_per_level():
    ok = checks.check_router_imbalance({"policy": "round_robin", "even_split": True,
                                        "levels": [level(16, [8.0, 8.1])]}, TOL)
    assert ok.passed, ok.reason
    bad = checks.check_router_imbalance({"policy": "round_robin", "even_split": True,
                                         "levels": [level(16, [8.0, 8.1]), level(20, [12.0, 8.0])]}, TOL)
    assert not bad.passed and "outside the allowance at 20 users" in bad.reason  # 4.0 > max(1, 0.05 x 20)


def test_uneven_split_is_judged_on_fleet_running_where_requests_wait():
    figs = {"policy": "random", "even_split": False,
            "levels": [level(16, [7.0, 7.5], predicted_running=15.5),  # nothing predicted to wait: skipped
                       level(32, [13.0, 13.0], predicted_running=27.0, predicted_waiting=5.0, sd=0.4)]}
    res = checks.check_router_imbalance(figs, TOL)
    assert res.passed and res.measured == [26.0] and res.predicted == [27.0]  # |26 - 27| <= max(1, 1.6, 0.8)
    figs["levels"][1]["predicted"]["fleet_running"] = 29.0
    assert not checks.check_router_imbalance(figs, TOL).passed  # 3.0 > 1.6
    figs["levels"] = figs["levels"][:1]
    assert checks.check_router_imbalance(figs, TOL).inconclusive


def test_usage_while_waiting_reads_only_the_queued_samples_after_warmup():
    t = np.arange(0.0, 10.0, 1.0)
    waiting = np.array([5, 5, 5, 0, 0, 2, 2, 0, 1, 1], float)
    usage = np.array([0.1, 0.1, 0.1, 0.5, 0.5, 0.9, 0.8, 0.4, 0.7, np.nan])
    out = checks.usage_when_waiting({"t": t, "usage": usage, "waiting": waiting},
                                    [LevelWindow(users=4, t_start=0.0, t_end=9.0)], warmup_fraction=1 / 3)
    # after t=3: waiting at t=5, 6, 8 (t=9 has no usage): usage mean (0.9+0.8+0.7)/3; 3 of 7 samples
    assert out[0][0] == pytest.approx(0.8) and out[0][1] == pytest.approx(3 / 7)


def test_fleet_sample_sums_counts_and_averages_usage_and_a_missing_replica_voids_the_tick():
    a = Sample(t=1.0, ok=True, running=3, waiting=1, usage=0.5, preemptions=2, used_tokens=10)
    b = Sample(t=1.2, ok=True, running=4, waiting=0, usage=0.7, preemptions=0, used_tokens=20)
    s = combine([a, b])
    assert (s.ok, s.running, s.waiting, s.preemptions, s.used_tokens) == (True, 7, 1, 2, 30)
    assert s.usage == pytest.approx(0.6) and s.t == pytest.approx(1.1) and s.waiting_capacity is None
    bad = combine([a, Sample(t=1.1, ok=False, error="HTTP 500")])
    assert not bad.ok and bad.running is None and "replica 1: HTTP 500" in bad.error


def test_router_imbalance_is_not_read_from_sampled_gauges():
    res = checks.check_router_imbalance({"policy": "round_robin", "even_split": True,
                                         "levels": [level(16, [8.0, 8.0])]}, TOL, gauge_exact=False)
    assert res.inconclusive and "samples" in res.reason
