"""Calibration that survives a loaded machine: a median of requests timed alone, and a hold in
request lifetimes capped by the profile's time budget, said when the cap bites."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from kvprobe.engines import get_dialect
from kvprobe.load.ramps import around_prediction_levels
from kvprobe.observe import oneshot
from kvprobe.observe.oneshot import OneShot
from kvprobe.probe import calibrate as probe
from kvprobe.probe.strategy import PredictRamp
from kvprobe.spec.profile import load_profile
from kvprobe.spec.schema import RampSpec


@pytest.fixture
def long_exp(expectation):
    """The shipped vLLM expectation with the shipped `long` profile's hold (3 lifetimes)."""
    exp = expectation("emulated-vllm.yaml")
    long = load_profile("long")
    profile = replace(exp.profile, hold=long.hold, budget_seconds=400, drain_seconds=20)
    return replace(exp, profile=profile)


def test_one_slow_request_does_not_set_the_hold(long_exp, monkeypatch):
    """One calibration request once took 37.6 s on a loaded machine; three give the median."""
    times = iter([37.6, 1.2, 1.0])
    sent = []

    def fake_post(url, body, **kw):
        sent.append(body["prompt"][0])
        return OneShot(200, next(times), 0.1, 128, 32, "")

    monkeypatch.setattr(oneshot, "post_completion", fake_post)
    target = SimpleNamespace(dialect=get_dialect("vllm"), url="http://x", headers={})
    lifetime, seen = probe.calibrate(target, long_exp, "m", requests=probe.CALIBRATION_REQUESTS)
    assert (lifetime, seen) == (1.2, [37.6, 1.2, 1.0])
    assert len(set(sent)) == 3  # each prompt unique from its first token: no prefix-cache hit


def test_two_requests_that_agree_settle_the_lifetime(long_exp, monkeypatch):
    """A third request would cost one more lifetime and could not move the median of two that agree."""
    times = iter([12.30, 12.45, 99.0])
    monkeypatch.setattr(oneshot, "post_completion", lambda *a, **k: OneShot(200, next(times), 0.1, 128, 32, ""))
    target = SimpleNamespace(dialect=get_dialect("vllm"), url="http://x", headers={})
    lifetime, seen = probe.calibrate(target, long_exp, "m", requests=probe.CALIBRATION_REQUESTS)
    assert seen == [12.30, 12.45] and lifetime == pytest.approx(12.375)


def test_calibration_refuses_inexact_lengths(long_exp, monkeypatch):
    monkeypatch.setattr(oneshot, "post_completion", lambda *a, **k: OneShot(200, 1.0, 0.1, 128, 31, ""))
    target = SimpleNamespace(dialect=get_dialect("vllm"), url="http://x", headers={})
    with pytest.raises(probe.ProbeError, match="does not honour fixed lengths"):
        probe.calibrate(target, long_exp, "m", requests=3)


def test_hold_in_lifetimes_is_capped_by_the_budget(long_exp):
    hold, note = probe.hold_seconds(long_exp, 1.0, levels=10, remaining=380)
    assert (hold, note) == (3.0, None)  # 3 lifetimes fit: 10 x 3 s + 20 s drain < 380 s
    hold, note = probe.hold_seconds(long_exp, 37.6, levels=10, remaining=380)
    assert hold == pytest.approx(36.0)  # (380 - 20) / 10, not 3 x 37.6 = 112.8
    assert note == ("hold capped at 36.0s per level by the time budget (10 levels in 380s left of budget_seconds "
                    "400); 3 lifetimes would be 112.8s; shorter than one request (37.60s): raise budget_seconds "
                    "for a steady state")
    hold, note = probe.hold_seconds(long_exp, 20.0, levels=10, remaining=380)
    assert hold == pytest.approx(36.0) and "shorter than one request" not in note


def test_a_hold_in_seconds_is_the_profiles(expectation):
    exp = expectation("emulated-vllm.yaml")
    assert probe.hold_seconds(exp, 99.0, levels=100, remaining=1.0) == (exp.profile.hold.seconds, None)


def test_planned_levels_follow_the_ramp(long_exp, expectation):
    assert probe.planned_levels(expectation("emulated-vllm.yaml"), 20.4) == 4  # the tiny profile's explicit levels
    around = replace(long_exp, profile=replace(long_exp.profile, ramp=RampSpec("around-prediction", window=3, above=3)))
    assert probe.planned_levels(around, 20.4) == len(around_prediction_levels(20.4, below=4, window=3, above=3))
    predict = replace(long_exp, profile=replace(long_exp.profile, ramp=load_profile("long").ramp))
    assert probe.planned_levels(predict, 20.4) == len(PredictRamp(20.4).planned())
    bisect = replace(long_exp, profile=replace(long_exp.profile, ramp=load_profile("bisect").ramp))
    assert probe.planned_levels(bisect, 20.4) == 9 + 4  # ceil(log2(257)) + 2 confirmations x 2
