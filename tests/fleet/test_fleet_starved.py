"""The shipped fleet expectation with its load generator starved on purpose
(KVPROBE_TEST_CLIENT_STALL_MS): emulated vLLM replicas behind the real sglang-router. The issue's
case — usage_gap and router_imbalance judged a starved load and failed a correct fleet — must end
inconclusive, each load check saying why."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvprobe.load.health import STALL_ENV
from kvprobe.probe.run import ProbeOptions, run_probe
from kvprobe.spec.expectation import load_expectations

FLEET = Path(__file__).resolve().parents[2] / "expectations" / "fleet" / "emulated-vllm-fleet.yaml"
LOAD_CHECKS = ("rejection_point", "usage_gap", "replica_usage", "router_imbalance")
ENGINE_CHECKS = ("reported_capacity", "leak", "exactness", "replica_leak")


@pytest.mark.slow
def test_a_starved_client_makes_the_fleet_inconclusive_not_failed(tmp_path, router_binary, monkeypatch):
    monkeypatch.setenv(STALL_ENV, "40")  # ms blocked per 50 ms: lag p99 ~40 ms, every second
    exp = load_expectations(FLEET)[0]
    assert set(exp.checks) == set(LOAD_CHECKS + ENGINE_CHECKS)  # the shipped checks, every one judged here
    exp = replace(exp, profile=replace(exp.profile, ramp=replace(exp.profile.ramp, levels=(16, 26))))
    result = run_probe(exp, ProbeOptions(artifacts_dir=tmp_path / "art"))
    assert result.error is None, result.error
    failed = [(c.name, c.reason) for c in result.checks if not c.passed and not c.inconclusive]
    assert not failed, failed
    reasons = {result.check(name).reason for name in LOAD_CHECKS}
    assert len(reasons) == 1, reasons  # one reason, said the same way by every load check
    reason = reasons.pop()
    # the starved levels the plateau is read from are named (a starved level below it changes no judged figure)
    named = [lv.users for lv in result.levels
             if lv.client_saturated and lv.users in result.rejection.saturated_levels]
    assert 26 in named, result.levels
    where = ", ".join(map(str, named))
    assert reason.startswith(f"the load generator was the bottleneck, not the engine (at N={where}: loop lag p99 up to")
    assert all(result.check(name).inconclusive for name in LOAD_CHECKS)
    for name in ENGINE_CHECKS:
        assert result.check(name).passed, (name, result.check(name).reason)
    assert result.status == "error"
