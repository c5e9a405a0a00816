"""A starved load generator never fails a check: the probe's analysis and judgement on a synthetic
run (the shipped emulated-vLLM expectation's ledger, a sampled series and request and loop-lag
records written here), with the client healthy and then saturated at the deep levels."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvprobe.analysis.client import mark_levels, starvation
from kvprobe.analysis.levels import LevelStats, LevelWindow
from kvprobe.load.health import client_health
from kvprobe.load.records import Record
from kvprobe.probe import judge as probe_judge
from kvprobe.probe.run import ProbeOptions, begin
from kvprobe.spec.expectation import load_expectations
from kvprobe.spec.schema import CHECKS, FLEET_CHECKS
from kvprobe.targets.interface import OneEngine
from kvprobe.verdict.checks import READS_LOAD, CheckResult, unjudged_if_starved
from kvprobe.verdict.fleet import check_replica_leak, check_replica_usage, check_router_imbalance

SHIPPED = Path(__file__).resolve().parents[2] / "expectations" / "emulated-vllm.yaml"
LEVELS = (10, 16, 24, 30, 36)
HOLD, INTERVAL, T0 = 3.0, 0.1, 1_000.0
PLATEAU = 20.5  # the ledger predicts 20.24 (KV binds) with the gauge at 95.5%
USAGE = 0.80  # what the starved run's gauge read on the plateau: usage_gap fails on it when judged
LOAD_CHECKS = ("rejection_point", "no_preemption", "usage_gap")
ENGINE_CHECKS = ("reported_capacity", "leak", "exactness")


class Series:
    def __init__(self, arrays):
        self._arrays = arrays

    def arrays(self):
        return self._arrays


def synthetic_series():
    """Running follows N below the plateau, then alternates 20 and 21 with the rest waiting; the
    usage gauge at USAGE there; after the stop, ten samples of zero."""
    t, running, waiting, usage = [], [], [], []
    for i, n in enumerate(LEVELS):
        for k in range(int(HOLD / INTERVAL)):
            run = 0.97 * n if n < PLATEAU else (20.0 if k % 2 else 21.0)
            t.append(T0 + i * HOLD + k * INTERVAL)
            running.append(run)
            waiting.append(max(0.0, n - run) if n > PLATEAU else 0.0)
            usage.append(USAGE if n > PLATEAU else USAGE * run / PLATEAU)
    stop = T0 + len(LEVELS) * HOLD
    for k in range(10):
        t.append(stop + k * INTERVAL)
        running.append(0.0)
        waiting.append(0.0)
        usage.append(0.0)
    size = len(t)
    arrays = {"t": np.array(t), "running": np.array(running), "waiting": np.array(waiting),
              "usage": np.array(usage), "preemptions": np.zeros(size), "waiting_capacity": np.full(size, np.nan),
              "used_tokens": np.full(size, np.nan), "ok": np.ones(size, dtype=bool)}
    return Series(arrays), stop


def lag_records(starved_levels=(), lag_ms=60.0):
    """One loop-lag record a second, as the Locust process writes them: 3 ms, or `lag_ms` while a
    starved level is held."""
    out = []
    for i, n in enumerate(LEVELS):
        for s in range(int(HOLD)):
            out.append(Record(kind="lag", worker="w0", t=T0 + i * HOLD + s + 0.5, cpu=0.3,
                              lag_ms=lag_ms if n in starved_levels else 3.0))
    return out


def probe_run(tmp_path, starved_levels=()):
    exp = load_expectations(SHIPPED)[0]
    exp = replace(exp, checks=LOAD_CHECKS + ENGINE_CHECKS,
                  profile=replace(exp.profile, hold=replace(exp.profile.hold, warmup=0.3)))
    pr = begin(exp, ProbeOptions(artifacts_dir=tmp_path / "art"))
    cap = pr.result.ledger["capacity"]
    from kvprobe.engines.base import ReportedCapacity

    pr.result.facts = type("Facts", (), {"reported": ReportedCapacity(num_blocks=cap["num_blocks"],
                                                                       kv_tokens=cap["kv_tokens"])})()
    pr.target = OneEngine()
    pr.series, pr.t_stop = synthetic_series()
    pr.windows = [LevelWindow(n, T0 + i * HOLD, T0 + (i + 1) * HOLD) for i, n in enumerate(LEVELS)]
    exact = [Record(t_send=T0 + k, t_first=T0 + k + 0.1, t_end=T0 + k + 1.0, status=200, prompt_tokens=128,
                    completion_tokens=32, users=10, worker="w0") for k in range(3)]
    pr.records = exact + lag_records(starved_levels)
    pr.result.client = client_health(pr.records)
    probe_judge.analyse(pr)
    probe_judge.judge(pr)
    return pr


def test_healthy_client_the_usage_gap_fails_on_what_the_gauge_read(tmp_path):
    result = probe_run(tmp_path).result
    assert result.check("rejection_point").passed, result.check("rejection_point").reason
    gap = result.check("usage_gap")
    assert not gap.passed and not gap.inconclusive and gap.measured == pytest.approx(USAGE, abs=0.01)
    assert result.status == "failed"


def test_a_starved_client_leaves_every_load_check_unjudged_with_one_reason(tmp_path):
    pr = probe_run(tmp_path, starved_levels=(30, 36))
    result = pr.result
    assert [lv.users for lv in result.levels if lv.client_saturated] == [30, 36]
    assert result.levels[-1].client_lag_p99_ms == pytest.approx(60.0)
    load = [result.check(name) for name in LOAD_CHECKS]
    for check in load:
        assert check.inconclusive and not check.passed, check
    reasons = {check.reason for check in load}
    assert len(reasons) == 1, reasons
    reason = reasons.pop()
    assert reason.startswith("the load generator was the bottleneck, not the engine")
    assert "N=30, 36" in reason and "loop lag p99 up to 60.0 ms > 15 ms" in reason, reason
    assert result.check("usage_gap").measured == pytest.approx(USAGE, abs=0.01)  # kept for the record
    for name in ENGINE_CHECKS:  # the engine's own report, the drain, each response: judged as usual
        assert result.check(name).passed, result.check(name)
    assert result.status == "error" and "the load generator was the bottleneck" in result.status_reason
    assert result.diagnosis.client_saturated


def test_a_run_whose_client_saturated_as_a_whole_names_the_run(tmp_path):
    records = lag_records(starved_levels=LEVELS, lag_ms=40.0)
    levels = [LevelStats(users=n, running_mean=0, running_max=0, waiting_mean=0, waiting_max=0, usage_mean=0,
                         usage_max=0, preemptions=None, preemption_rate_per_s=None, samples=30,
                         t_start=T0 + 50 + i, t_end=T0 + 50.5 + i)  # too short to hold a lag record
              for i, n in enumerate(LEVELS)]
    mark_levels(levels, records, warmup_fraction=0.3)
    assert not any(lv.client_saturated for lv in levels)
    starved = starvation(levels, client_health(records))
    assert starved is not None and starved.reason.startswith("over the whole run: loop lag p99 40.0 ms")
    assert starvation(levels, client_health(lag_records())) is None


def test_healthy_judged_levels_are_not_overruled_by_the_runs_median(tmp_path):
    # every second lagged except the deep levels' steady windows: the run's median says saturated,
    # but no figure a check is judged on came from a lagged second
    pr = probe_run(tmp_path)
    levels = pr.result.levels
    deep = set(pr.result.rejection.saturated_levels)
    assert deep and deep < set(LEVELS)

    def in_a_deep_steady_window(r) -> bool:
        return any(lv.users in deep and lv.t_start + 0.3 * HOLD <= r.t <= lv.t_end for lv in levels)

    records = [r if in_a_deep_steady_window(r) else replace(r, lag_ms=40.0) for r in lag_records()]
    whole = client_health(records)
    assert whole.saturated
    mark_levels(levels, records, warmup_fraction=0.3)
    assert {lv.users for lv in levels if lv.client_saturated} == set(LEVELS) - deep
    assert starvation(levels, whole, judged=deep) is None
    # a judged level without a lag figure of its own leaves the run's median to speak for it
    for lv in levels:
        if lv.users == max(deep):
            lv.client_lag_p99_ms = None
    starved = starvation(levels, whole, judged=deep)
    assert starved is not None and starved.levels == sorted(set(LEVELS) - deep), starved


def test_several_load_processes_name_the_one_that_saturated():
    records = lag_records() + [replace(r, worker="w1", host="loadB", lag_ms=30.0) for r in lag_records()]
    level = LevelStats(users=36, running_mean=0, running_max=0, waiting_mean=0, waiting_max=0, usage_mean=0,
                       usage_max=0, preemptions=None, preemption_rate_per_s=None, samples=30,
                       t_start=T0, t_end=T0 + len(LEVELS) * HOLD)
    mark_levels([level], records, warmup_fraction=0.0)
    starved = starvation([level], None)
    assert starved.levels == [36] and "saturated: worker w1 on loadB" in starved.reason, starved.reason


def test_every_check_declares_whether_it_reads_the_load():
    assert set(READS_LOAD) == set(CHECKS) | set(FLEET_CHECKS)
    assert {name for name, reads in READS_LOAD.items() if reads} == {
        "rejection_point", "no_preemption", "usage_gap", "replica_usage", "router_imbalance"}


def test_the_fleet_checks_of_a_starved_load_are_unjudged_too():
    starved = starvation([], type("Client", (), {"saturated": True, "reason": "loop lag p99 77.0 ms > 15 ms",
                                                 "lag_p99_ms": 77.0, "cpu": 0.5})())
    figures = {"policy": "round_robin", "even_split": True, "levels": [
        {"users": 26, "imbalance": 2.4, "running": 18.0, "predicted": {"imbalance": 0.0, "fleet_waiting": 8.0},
         "replicas": [{"samples": 20, "usage_when_waiting": 0.79, "waiting_fraction": 1.0}] * 2}]}
    tol = load_expectations(SHIPPED)[0].tolerances
    imbalance = check_router_imbalance(figures, tol)
    usage = check_replica_usage(figures, 0.92, 0.05)
    assert not imbalance.passed and not imbalance.inconclusive  # judged: both fail on these figures
    assert not usage.passed and not usage.inconclusive
    for check in (imbalance, usage):
        unjudged_if_starved(check, starved)
        assert check.inconclusive and "loop lag p99 77.0 ms" in check.reason
    drained = check_replica_leak([], None, "blocks")
    leak = unjudged_if_starved(CheckResult("replica_leak", passed=True, reason="drained"), starved)
    assert leak.passed and not leak.inconclusive and drained.inconclusive  # the drain is not the load's


def test_one_second_spike_does_not_starve_a_level_most_seconds_do():
    def level_with(lags):
        lv = LevelStats(users=24, running_mean=0, running_max=0, waiting_mean=0, waiting_max=0, usage_mean=0,
                        usage_max=0, preemptions=None, preemption_rate_per_s=None, samples=30,
                        t_start=T0, t_end=T0 + len(lags))
        mark_levels([lv], [Record(kind="lag", worker="w0", t=T0 + s + 0.5, cpu=0.2, lag_ms=ms)
                           for s, ms in enumerate(lags)], warmup_fraction=0.0)
        return lv

    assert not level_with([4.0, 40.0]).client_saturated  # a spike: another process scheduled over it
    assert not level_with([4.0, 40.0, 5.0]).client_saturated
    assert level_with([40.0, 4.0, 38.0]).client_saturated
    assert level_with([40.0, 35.0]).client_saturated


def test_a_starved_level_below_the_plateau_leaves_the_checks_judged(tmp_path):
    # a burst on a shared machine while 10 users ran: no figure a check is judged on came from it
    result = probe_run(tmp_path, starved_levels=(10,)).result
    assert [lv.users for lv in result.levels if lv.client_saturated] == [10]
    gap = result.check("usage_gap")
    assert not gap.passed and not gap.inconclusive, gap
    assert result.check("rejection_point").passed and result.status == "failed"


def test_the_lag_a_level_tolerates_grows_with_its_request_lifetime():
    # CI once left a long-output SGLang probe unjudged for 18.9 ms of lag against 15 ms, with each
    # request living seconds: one lag per request cycle is then a fraction of a percent of the load
    def level_with(lifetime, lag_ms):
        lv = LevelStats(users=6, running_mean=0, running_max=0, waiting_mean=0, waiting_max=0, usage_mean=0,
                        usage_max=0, preemptions=None, preemption_rate_per_s=None, samples=30,
                        t_start=T0, t_end=T0 + 10)
        requests = [Record(t_send=T0 + k, t_first=T0 + k + 0.1, t_end=T0 + k + lifetime, status=200,
                           prompt_tokens=512, completion_tokens=4096, users=6, worker="w0") for k in range(5)]
        lags = [Record(kind="lag", worker="w0", t=T0 + s + 0.5, cpu=0.3, lag_ms=lag_ms) for s in range(10)]
        mark_levels([lv], requests + lags, warmup_fraction=0.0)
        return lv

    assert level_with(0.4, 19.0).client_saturated  # a 0.4 s request: 15 ms is the floor
    long = level_with(4.0, 19.0)
    assert not long.client_saturated and long.client_lag_limit_ms == pytest.approx(40.0)
    starved = level_with(4.0, 60.0)
    assert starved.client_saturated
    assert "loop lag p99 up to 60.0 ms > 40 ms" in starvation([starved], None).reason
    run = [Record(t_send=T0 + k, t_end=T0 + k + 4.0, status=200, worker="w0") for k in range(3)]
    assert not client_health(run + lag_records(starved_levels=LEVELS, lag_ms=19.0)).saturated
    assert client_health(run + lag_records(starved_levels=LEVELS, lag_ms=45.0)).saturated
