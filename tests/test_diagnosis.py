"""Diagnoses from signatures: a request cap is named as a request cap, with
the flag that differs from the expectation where the engine reports it — never as a pool bug."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvprobe.analysis.diagnosis import diagnose
from kvprobe.analysis.levels import LevelStats
from kvprobe.analysis.plateau import find_rejection_point
from kvprobe.engines import get_dialect
from kvprobe.engines.base import ReportedCapacity
from kvprobe.spec.expectation import Tolerances
from kvprobe.theory.sim.core import SglangConfig, VllmConfig
from kvprobe.verdict.checks import check_no_preemption, check_rejection_point, check_usage_gap, unjudged_if_starved

TOL = Tolerances()
# Real vLLM 0.33.0, P=512 O=256, the pool of the issue: the ledger's 24.21, KV binds, the gauge at 96%.
PRED = SimpleNamespace(limit=24.21, no_preemption_limit=22, binding="kv", usage_at_limit=0.96)
VLLM = VllmConfig(num_gpu_blocks=1000, max_num_seqs=256, max_num_batched_tokens=2048)


def level(users, running, waiting, *, usage, preemptions=0.0, se=0.0, high=None):
    high = float(round(running) + 1) if high is None else float(high)  # the gauge's highest reading
    return LevelStats(users=users, running_mean=running, running_max=high, waiting_mean=waiting,
                      waiting_max=waiting, usage_mean=usage, usage_max=usage, preemptions=preemptions,
                      preemption_rate_per_s=0.0, samples=30, running_se=se, engine_running_max=high)


def capped(cap=16, usage=0.64):
    """Started with --max-num-seqs 16: running pinned at exactly 16.0 on every saturated level, the
    gauge flat at 64%, no preemption (the issue's figures)."""
    below = [level(n, 0.95 * n, 0.05, usage=usage * 0.95 * n / cap) for n in (4, 8, 12)]
    return below + [level(n, float(cap), n - cap * 1.06, usage=usage, high=cap) for n in (20, 24, 28, 32, 40)]


def run(levels, *, reported=None, config=VLLM, engine="vllm", pred=PRED, client=None):
    rejection = find_rejection_point(levels)
    diagnosis = diagnose(prediction=pred, rejection=rejection, levels=levels, allowance=1.21, usage_tol=0.05,
                         client=client, reported=reported or ReportedCapacity(), config=config,
                         dialect=get_dialect(engine), prompt_tokens=512, output_tokens=256, reported_agrees=True)
    return rejection, diagnosis


def test_finding_4_a_request_cap_is_named_not_blamed_on_the_pool():
    rejection, d = run(capped())
    assert rejection.rejection_point == pytest.approx(16.0) and rejection.confirmed
    assert d.limit == "max_num_seqs" and d.flag == "max-num-seqs" and d.expected == 256 and d.reported is None
    assert "a request cap binds at 16" in d.reason and "KV 64% used" in d.reason and "no preemption" in d.reason
    assert "never above 16" in d.reason
    assert "max_num_seqs=256" in d.reason  # the expectation's value, beside the 16 measured
    checks = [check_rejection_point(PRED, rejection, TOL, reported_agrees=True, diagnosis=d),
              check_usage_gap(PRED, rejection, TOL.usage_gap, reported_agrees=True, diagnosis=d),
              check_no_preemption(PRED, rejection, TOL, reported_agrees=True, diagnosis=d)]
    for c in checks:
        assert not c.passed and not c.inconclusive and c.diagnosis == "max_num_seqs", c
        assert "smaller than reported" not in c.reason and "misreports" not in c.reason, c.reason
    assert "a request cap binds at 16" in checks[0].reason and "a request cap binds at 16" in checks[1].reason


def test_where_the_engine_reports_its_cap_the_differing_flag_is_named():
    _, d = run(capped(), reported=ReportedCapacity(max_running=16, sources={"max_running": "startup log"}))
    assert d.reported == 16 and "the engine reports max_num_seqs=16, the expectation says 256" in d.reason


def test_a_short_request_reads_below_its_cap_and_is_still_a_cap():
    """The emulator at O=32: a finished request's slot waits a step for the next, so 16 reads 15.4."""
    levels = capped()
    for lv in levels[3:]:
        lv.running_mean = 15.4
    _, d = run(levels)
    assert d.limit == "max_num_seqs"
    for lv in levels[3:]:
        lv.engine_running_max = lv.running_max = 17.0  # one level above the ceiling: no cap
    assert run(levels)[1].limit != "max_num_seqs"


def test_sglang_names_max_running_requests_from_server_info():
    cfg = SglangConfig(max_total_num_tokens=30000, max_running_requests=1650)
    pred = SimpleNamespace(limit=38, no_preemption_limit=38, binding="kv", usage_at_limit=0.97)
    levels = [level(n, 0.95 * n, 0.1, usage=0.3 * n / 12) for n in (4, 8)] + \
        [level(n, r, n - 13, usage=0.31, preemptions=None, high=h) for n, r, h in
         ((16, 11.9, 12), (20, 12.28, 11), (24, 12.0, 11), (28, 11.8, 12))]
    for lv in levels:  # SGLang: running is the client's count; its gauge missed the full batch at 20 and 24
        lv.running_source = "client"
    _, d = run(levels, reported=ReportedCapacity(max_running=12), config=cfg, engine="sglang", pred=pred)
    assert d.limit == "max_running_requests"
    assert "preemption counter absent" in d.reason  # absent is not zero (finding 6)
    assert "the engine reports max_running_requests=12, the expectation says 1650" in d.reason


def test_kv_binding_with_preemptions_is_kv():
    levels = [level(n, 0.95 * n, 0.05, usage=0.9 * n / 24) for n in (6, 12, 18)] + \
        [level(n, 24.15 + 0.02 * (n % 3), n - 25.6, usage=0.955, preemptions=8) for n in (28, 30, 32, 36)]
    rejection, d = run(levels)
    assert d.limit == "kv" and "KV binds" in d.reason and "preemptions" in d.reason


def test_a_pool_smaller_than_reported():
    levels = [level(n, 0.95 * n, 0.05, usage=0.9 * n / 18) for n in (6, 12)] + \
        [level(n, 18.2, n - 19.2, usage=0.97, preemptions=20) for n in (22, 26, 30, 34)]
    _, d = run(levels)
    assert d.limit == "pool" and "real pool is smaller than reported" in d.reason


def test_the_token_budget_binds_where_budget_x_o_over_p_plus_o_says():
    cfg = VllmConfig(num_gpu_blocks=100000, max_num_seqs=1024, max_num_batched_tokens=512)
    pred = SimpleNamespace(limit=300, no_preemption_limit=300, binding="kv", usage_at_limit=0.97)
    bound = 512 * 256 / (512 + 256)  # 170.7 running: each step decodes them and prefills their successors
    levels = [level(n, 0.95 * n, 0.1, usage=0.2 * n / 170) for n in (40, 80, 120)] + \
        [level(n, bound + 0.3 * (n % 2 - 0.5), n - 180, usage=0.22) for n in (200, 220, 240, 260)]
    _, d = run(levels, config=cfg, pred=pred)
    assert d.limit == "token_budget" and "max_num_batched_tokens=512 holds 170.7 running" in d.reason


def test_admission_stopped_for_good_before_the_ramp_saw_a_plateau():
    """The emulator's stuck-admission trips the first time the pool is full: every level after it
    runs nothing while everyone waits."""
    levels = [level(10, 9.5, 0.0, usage=0.45), level(16, 15.1, 0.2, usage=0.7), level(20, 18.6, 0.6, usage=0.9),
              level(24, 0.0, 24.0, usage=0.0), level(28, 0.0, 28.0, usage=0.0), level(32, 0.0, 32.0, usage=0.0)]
    _, d = run(levels)
    assert d.limit == "stuck" and "from 18.6 at N=20 to 0.0 at N=32 while 32.0 requests waited" in d.reason


def test_one_disturbed_last_level_is_not_stuck():
    levels = [level(n, 0.95 * n, 0.05, usage=0.9 * n / 24) for n in (6, 12, 18)] + \
        [level(n, 24.1, n - 25.6, usage=0.955, preemptions=8) for n in (28, 30, 32)] + \
        [level(36, 15.0, 20.0, usage=0.9)]
    assert run(levels)[1].limit != "stuck"


def test_admission_stopped_for_good():
    levels = [level(10, 9.5, 0.0, usage=0.5), level(16, 15.2, 0.1, usage=0.8), level(24, 20.0, 3.5, usage=0.96,
              preemptions=3), level(28, 9.0, 18.0, usage=0.95), level(32, 2.0, 29.0, usage=0.95)]
    rejection, d = run(levels)
    assert d.limit == "stuck" and "admission stopped for good" in d.reason and "N=32" in d.reason
    res = check_rejection_point(PRED, rejection, TOL, reported_agrees=True, diagnosis=d)
    assert not res.passed and not res.inconclusive and "admission stopped for good" in res.reason


def test_a_saturated_client_is_said_first():
    client = SimpleNamespace(saturated=True, reason="loop lag p99 41.0 ms > 15 ms")
    rejection, d = run(capped(), client=client)
    assert d.client_saturated and d.reason.startswith("the load generator saturated (loop lag p99 41.0 ms")
    assert "a request cap binds at 16" in d.reason  # what the levels show, as a caveat
    res = unjudged_if_starved(check_rejection_point(PRED, rejection, TOL, reported_agrees=True, diagnosis=d), client)
    assert res.inconclusive and "load generator" in res.reason  # the probe could not measure: an error


def test_a_ceiling_below_the_cap_the_engine_reports_is_not_the_cap():
    """vLLM emulated with --max-num-batched-tokens 64 --max-num-seqs 64 at P=128, O=32: running
    never exceeds 14 (13.54 on average) — a ceiling, but the engine reports max_num_seqs=64, so it
    is the step budget: 64 x 32 / 160 = 12.8."""
    cfg = VllmConfig(num_gpu_blocks=201, max_num_seqs=256, max_num_batched_tokens=2048)
    pred = SimpleNamespace(limit=20.41, no_preemption_limit=20, binding="kv", usage_at_limit=0.961)
    levels = [level(10, 9.33, 0.0, usage=0.43)] + [level(n, 13.55, n - 14.5, usage=0.61, high=14)
                                                   for n in (20, 24, 28, 32, 36)]
    rejection = find_rejection_point(levels)
    d = diagnose(prediction=pred, rejection=rejection, levels=levels, allowance=1.02, usage_tol=0.05,
                 reported=ReportedCapacity(max_running=64, token_budget=64), config=cfg, dialect=get_dialect("vllm"),
                 prompt_tokens=128, output_tokens=32, reported_agrees=True)
    assert d.limit == "token_budget" and "max_num_batched_tokens=64 holds 12.8 running" in d.reason
    assert "the engine reports max_num_batched_tokens=64, the expectation says 2048" in d.reason


def test_a_cap_the_ledger_predicts_binds_as_predicted():
    """Discovery builds the ledger from what SGLang publishes: max_running_requests=12."""
    pred = SimpleNamespace(limit=12, no_preemption_limit=12, binding="max_running_requests", usage_at_limit=0.5)
    levels = [level(n, 0.95 * n, 0.1, usage=0.5 * n / 12) for n in (4, 8)] + \
        [level(n, 12.0, n - 13, usage=0.5, preemptions=None, high=12) for n in (16, 20, 24, 28)]
    _, d = run(levels, reported=ReportedCapacity(max_running=12), config=SglangConfig(max_total_num_tokens=3300,
               max_running_requests=12), engine="sglang", pred=pred)
    assert d.limit == "max_running_requests" and d.reason.startswith("max_running_requests binds as predicted")
