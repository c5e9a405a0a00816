"""The `predict` ramp end to end on both engines' emulators (mark.slow: the end-to-end lane): the
verdict of the shipped expectation, from the levels the strategy chose, with the cost per level
in seconds and request lifetimes in the result."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprobe.probe.hold import STARVED_EXTRA
from kvprobe.probe.run import ProbeOptions, run_probe
from kvprobe.probe.strategy import deep_users
from kvprobe.spec.expectation import load_expectations

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_predict_ramp_reaches_the_verdict_from_deep_levels(engine, tmp_path):
    exp = load_expectations(ROOT / "expectations" / f"emulated-{engine}.yaml")[0]
    result = run_probe(exp, ProbeOptions(artifacts_dir=tmp_path, profile="predict"))
    assert result.passed, result.status_reason
    limit = result.check("rejection_point").predicted
    users = [lv.users for lv in result.levels]
    assert users[0] < limit and deep_users(limit) in users, users
    assert len(result.rejection.deep_levels) >= 2 and len(users) <= 6, (users, result.rejection.deep_levels)
    ramp = result.ramp
    assert ramp["strategy"] == "predict" and [x["users"] for x in ramp["levels"]] == users
    lifetime = ramp["lifetime_s"]
    for i, level in enumerate(ramp["levels"]):  # every level outlasts a request, and none exceeds its hold plus warm-up
        # ... unless its client lagged (an engine starting beside the probe): then held on, up to as long again
        longest = (4 * lifetime + 1.0) * (1 + STARVED_EXTRA if level["held_for_lag"] else 1)
        assert lifetime <= level["seconds"] <= longest, level
        if level["start_jitter_s"]:
            # its steady part starts once its last new user has sent a first request (each waits up
            # to a lifetime, the start jitter): before, running still climbs below the knee
            assert level["start_jitter_s"] == pytest.approx(lifetime, abs=0.01), level
            assert level["warmup_s"] >= lifetime - 0.01, level
        else:  # no jitter only where the new users' requests join a queue in the engine
            before = result.levels[i - 1]
            assert i > 0 and before.users < level["users"], users
            assert before.waiting_mean >= max(1.0, 0.1 * before.users), (before, level)
    assert ramp["lifetimes"] == pytest.approx(ramp["seconds"] / lifetime, rel=0.01)
    report = (tmp_path / "report.txt").read_text()
    assert f"ramp: predict, {len(users)} levels in {ramp['seconds']:.1f}s = {ramp['lifetimes']:.1f} request" in report
