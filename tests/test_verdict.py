"""The checks on plain data: each can pass, fail and be inconclusive, with a reason that says why."""

from __future__ import annotations

from types import SimpleNamespace

from kvprobe.analysis.levels import DrainResult
from kvprobe.analysis.plateau import RejectionPoint
from kvprobe.engines.base import ReportedCapacity
from kvprobe.load.records import Record
from kvprobe.spec.expectation import Tolerances
from kvprobe.verdict.checks import (
    check_exactness,
    check_leak,
    check_no_preemption,
    check_rejection_point,
    check_reported_capacity,
    check_usage_gap,
    unjudged_if_starved,
)
from kvprobe.verdict.fleet import check_replica_leak

TOL = Tolerances()
PRED = SimpleNamespace(limit=20.41, no_preemption_limit=20, binding="kv", usage_at_limit=0.96)


def rejection(point, *, spread=0.3, usage=0.95, uncertainty=0.2, deep=(22, 24)):
    """A plateau measured on levels 22 and 24, both deep (confirmed) unless `deep` says otherwise."""
    return RejectionPoint(point, 20, point, [22, 24], usage, plateau_spread=spread, levels_seen=[10, 20, 22, 24],
                          uncertainty=uncertainty, deep_levels=list(deep), deep_waiting=2.2,
                          confirmed=len(deep) >= 2)


def test_rejection_point_within_and_outside_with_a_diagnosis():
    ok = check_rejection_point(PRED, rejection(20.1), TOL, reported_agrees=True)
    assert ok.passed and "within" in ok.reason
    low = check_rejection_point(PRED, rejection(15.0), TOL, reported_agrees=True)
    assert not low.passed and "admits fewer requests" in low.reason
    stuck = check_rejection_point(PRED, rejection(6.0, spread=12), TOL, reported_agrees=True)
    assert "admission stopped for good" in stuck.reason
    sized = check_rejection_point(PRED, rejection(25.0), TOL, reported_agrees=False)
    assert not sized.passed and "sized its pool differently" in sized.reason


def test_a_reservation_engines_plateau_is_judged_against_what_it_holds_on_average():
    """SGLang 0.5.22 on admits up to its reservation bound (20) and refills a finished request's
    slot at the next admission: its running averages 19.52 at O=32 (the simulated time average), and
    the plateau, a time average, is judged against that — not against the bound it never holds."""
    sglang = SimpleNamespace(limit=20, limit_mean=19.52, no_preemption_limit=20, binding="kv", usage_at_limit=0.87)
    tight = Tolerances(rejection_point=0.3, rejection_point_relative=0.0)
    res = check_rejection_point(sglang, rejection(19.6, uncertainty=0.03), tight, reported_agrees=True)
    assert res.passed and res.predicted == 20, res.reason
    assert "predicts 20 at once, 19.52 on average" in res.reason
    held_to_the_bound = SimpleNamespace(limit=20, no_preemption_limit=20, binding="kv", usage_at_limit=0.87)
    assert not check_rejection_point(held_to_the_bound, rejection(19.6, uncertainty=0.03), tight,
                                     reported_agrees=True).passed


def test_with_a_differently_sized_pool_admission_is_judged_against_the_engines_own_pool():
    """A real GPU profiles its memory: the ledger's pool can be off while admission is right."""
    implied = SimpleNamespace(limit=25.2, no_preemption_limit=24, binding="kv", usage_at_limit=0.95)
    res = check_rejection_point(PRED, rejection(25.0), TOL, reported_agrees=False,
                                implied=implied)
    assert res.passed and res.predicted == 20.41 and res.reported == 25.2 and "engine's reported pool" in res.reason
    wrong = check_rejection_point(PRED, rejection(18.0), TOL, reported_agrees=False,
                                  implied=implied)
    assert not wrong.passed and "admits fewer requests than the pool it reports" in wrong.reason
    agree = check_rejection_point(PRED, rejection(25.0), TOL, reported_agrees=True,
                                  implied=PRED)
    assert not agree.passed and "the ledger predicts" in agree.reason


def test_rejection_point_is_inconclusive_when_unsaturated_or_client_bound():
    never = check_rejection_point(PRED, rejection(None), TOL)
    assert never.inconclusive and not never.passed and "no level saturated" in never.reason
    starved = SimpleNamespace(reason="at N=22, 24: loop lag p99 up to 41.0 ms > 15 ms")
    client = unjudged_if_starved(check_rejection_point(PRED, rejection(20.1), TOL), starved)
    assert client.inconclusive and not client.passed and "load generator" in client.reason
    assert "N=22, 24" in client.reason and client.measured == 20.1  # the figure stays for the record


def test_reported_capacity_relative_tolerance():
    ledger = {"capacity": {"num_blocks": 201, "kv_tokens": 3216}}
    assert check_reported_capacity(ledger, ReportedCapacity(num_blocks=201, kv_tokens=3216), 0.01).passed
    bad = check_reported_capacity(ledger, ReportedCapacity(num_blocks=150), 0.01)
    assert not bad.passed and "num_blocks=150" in bad.reason
    assert check_reported_capacity(ledger, ReportedCapacity(), 0.01).inconclusive


def test_leak_passes_only_when_drained():
    drained = DrainResult(True, 0.4, 0.0, 0.0, 0.0, 0, samples=30)
    assert check_leak(drained, 201, "blocks").passed
    leaked = DrainResult(False, None, 0.12, 0.0, 0.0, 24, samples=30)
    res = check_leak(leaked, 201, "blocks")
    assert not res.passed and "≈24 blocks leaked" in res.reason
    blind = DrainResult(False, None, None, None, None, None, samples=0)
    assert check_leak(blind, 201, "blocks").inconclusive


def test_usage_gap():
    assert check_usage_gap(PRED, rejection(20.1, usage=0.94), 0.05).passed
    low = check_usage_gap(PRED, rejection(20.1, usage=0.26), 0.05)
    assert not low.passed and "26%" in low.reason


def test_exactness_fails_on_one_mismatch_and_ignores_streams_cut_at_stop():
    good = [Record(status=200, prompt_tokens=128, completion_tokens=32) for _ in range(3)]
    assert check_exactness(good + [Record(status="aborted")], 128, 32).passed
    res = check_exactness(good + [Record(status="usage_mismatch", prompt_tokens=128, completion_tokens=30)], 128, 32)
    assert not res.passed and "128/30 != 128/32" in res.reason
    errors = check_exactness(good + [Record(status=500, error="boom")], 128, 32)
    assert not errors.passed and "1 requests failed" in errors.reason
    assert check_exactness([], 128, 32).inconclusive


def test_no_preemption_fails_where_the_policy_preempts_nothing_but_the_engine_does():
    """Clean up to the bound is not enough: at levels whose simulated steady state never preempts,
    preemptions mean the engine admits more than fits (vLLM's first-chunk admission)."""
    pred = SimpleNamespace(limit=9.85, no_preemption_limit=10, binding="kv", usage_at_limit=0.94, policy="vllm-0.33")
    clean = RejectionPoint(9.9, 10, 9.9, [14, 20], 0.94, onset_users=14, levels_seen=[6, 10, 14, 20])
    ok = check_no_preemption(pred, clean, TOL)
    assert ok.passed and ok.measured == 10
    bad = check_no_preemption(pred, clean, TOL, unpredicted=[(14, 37.0), (20, 52.0)])
    assert not bad.passed and not bad.inconclusive and bad.measured == 10
    assert "preempted at N=14 (37), N=20 (52), where the ledger's policy (vllm-0.33) preempts nothing" in bad.reason


def test_a_drain_that_ended_before_the_engines_idle_report_is_inconclusive():
    stale = DrainResult(False, None, 0.31, 0.0, 0.0, 62, samples=100, watched=10.0, idle_report_seconds=30.0,
                        covered=False)
    res = check_leak(stale, 201, "tokens")
    assert res.inconclusive and not res.passed
    assert "republishes its gauges only every 30s when idle" in res.reason and "watched 10.0s" in res.reason
    seen = DrainResult(False, None, 0.05, 0.0, 0.0, 10, samples=400, watched=39.9, idle_report_seconds=30.0)
    assert not check_leak(seen, 201, "tokens").passed and not check_leak(seen, 201, "tokens").inconclusive
    drained = DrainResult(True, 29.5, 0.0, 0.0, 0.0, 0, samples=400, watched=35.0, idle_report_seconds=30.0)
    replicas = check_replica_leak([drained, stale], 201, "tokens")
    assert replicas.inconclusive and replicas.reason.startswith("replica 1 still read usage"), replicas.reason
    assert check_replica_leak([drained, seen], 201, "tokens").reason.startswith("replica 1: usage 0.050")
