"""A starved load generator end to end: the emulator over real HTTP and a real Locust subprocess
that blocks its own loop on purpose (KVPROBE_TEST_CLIENT_STALL_MS): the verdict is inconclusive,
never a failure, and every check that reads the load says why."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvprobe.load.health import STALL_ENV
from kvprobe.probe.run import ProbeOptions, run_probe

pytestmark = pytest.mark.slow

LOAD_CHECKS = ("rejection_point", "no_preemption", "usage_gap")
ENGINE_CHECKS = ("reported_capacity", "leak", "exactness")


def assert_starved_verdict(result, load_checks, engine_checks):
    """No check fails; each load check is inconclusive naming the starved levels and the lag; the
    engine's own checks are judged."""
    assert result.error is None, result.error
    failed = [(c.name, c.reason) for c in result.checks if not c.passed and not c.inconclusive]
    assert not failed, failed
    for name in load_checks:
        check = result.check(name)
        assert check.inconclusive, (name, check.reason)
        assert check.reason.startswith("the load generator was the bottleneck, not the engine (at N="), check.reason
        assert "loop lag p99 up to" in check.reason, check.reason
    for name in engine_checks:
        assert result.check(name).passed, (name, result.check(name).reason)
    assert result.status == "error" and any(lv.client_saturated for lv in result.levels)


def test_a_starved_client_makes_one_engine_inconclusive(expectation, tmp_path, groups, monkeypatch):
    monkeypatch.setenv(STALL_ENV, "40")  # ms blocked per 50 ms: lag p99 ~40 ms, every second
    exp = expectation("emulated-vllm.yaml", checks=LOAD_CHECKS + ENGINE_CHECKS)
    exp = replace(exp, profile=replace(exp.profile, ramp=replace(exp.profile.ramp, levels=(10, 24, 32))))
    result = run_probe(exp, ProbeOptions(artifacts_dir=tmp_path / "art"))
    assert_starved_verdict(result, LOAD_CHECKS, ENGINE_CHECKS)
    for lv in result.levels:  # every level was served by the stalled process
        assert lv.client_saturated and lv.client_lag_p99_ms > 15, lv
    groups.assert_none_left()
