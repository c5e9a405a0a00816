"""Ramp strategies, pure: driven against synthetic engines, no server."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from kvprobe.errors import ConfigError
from kvprobe.load.ramps import (
    AroundPrediction,
    BisectRamp,
    ExplicitRamp,
    LevelResult,
    around_prediction_levels,
    make_ramp,
)


def engine(knee: int, flaps: dict[int, list[bool]] | None = None):
    """A synthetic engine: saturated above `knee`; `flaps` overrides successive answers per level."""
    flaps = {k: list(v) for k, v in (flaps or {}).items()}

    def measure(n: int) -> LevelResult:
        sat = flaps[n].pop(0) if flaps.get(n) else n > knee
        running = min(n, knee)
        return LevelResult(users=n, running=running, waiting=max(0, n - knee), preemption_rate=0.0, saturated=sat)

    return measure


def drive(ramp, measure, limit: int = 200) -> list[LevelResult]:
    history: list[LevelResult] = []
    while (n := ramp.next_level(history)) is not None:
        history.append(measure(n))
        assert len(history) < limit, "ramp did not terminate"
    return history


def test_explicit_runs_levels_in_order_then_stops():
    h = drive(ExplicitRamp([1, 4, 2]), engine(3))
    assert [x.users for x in h] == [1, 4, 2]


def test_explicit_rejects_empty_and_negative():
    with pytest.raises(ConfigError):
        ExplicitRamp([])
    with pytest.raises(ConfigError):
        ExplicitRamp([3, -1])


@pytest.mark.parametrize("pred", [1.0, 7.0, 37.5, 40.0, 250.0])
def test_around_prediction_dense_band_coarse_below_and_above(pred):
    lv = around_prediction_levels(pred, below=4, window=2, above=2)
    assert lv == sorted(set(lv)) and lv[0] >= 1
    for n in range(max(1, math.floor(pred) - 2), math.ceil(pred) + 3):
        assert n in lv, f"{n} missing near prediction {pred}"
    above = [x for x in lv if x > math.ceil(pred) + 2]
    assert len(above) == 2
    below = [x for x in lv if x < math.floor(pred) - 2]
    assert len(below) <= 4
    if pred >= 40:
        assert len(below) == 4  # room for all coarse levels


def test_around_prediction_respects_max_users_and_bad_prediction():
    assert max(around_prediction_levels(40, max_users=41)) == 41
    with pytest.raises(ConfigError):
        AroundPrediction(0)
    with pytest.raises(ConfigError):
        AroundPrediction(float("nan"))


@pytest.mark.parametrize("knee", [1, 2, 17, 63, 64, 99, 100])
def test_bisect_finds_knee_in_log_levels_and_confirms(knee):
    ramp = BisectRamp(1, 100, confirm=1)
    h = drive(ramp, engine(knee))
    assert ramp.knee(h) == knee
    assert len(h) <= math.ceil(math.log2(101)) + 1 + 2 * 1 + 1
    counts = {n: sum(1 for x in h if x.users == n) for n in (knee, knee + 1)}
    assert counts[knee] >= 2  # measured, then confirmed
    if knee < 100:
        assert counts[knee + 1] >= 2


def test_bisect_reports_none_when_lowest_level_saturates():
    ramp = BisectRamp(5, 50)
    h = drive(ramp, engine(2))
    assert ramp.knee(h) is None
    assert h[-1].users == 5


def test_bisect_reopens_search_when_confirmation_contradicts():
    # Level 50 first looks clean, then saturated on confirmation: the knee must move below it.
    ramp = BisectRamp(1, 100, confirm=1)
    h = drive(ramp, engine(40, flaps={50: [False, True]}))
    assert ramp.knee(h) == 40


def test_bisect_is_bounded_on_a_flapping_engine():
    ramp = BisectRamp(1, 100, confirm=2)
    flaps = {n: [n % 2 == 0, n % 2 == 1] * 50 for n in range(1, 101)}
    h = drive(ramp, engine(50, flaps=flaps))
    assert len(h) <= ramp.max_levels


@dataclass(frozen=True)
class Spec:
    strategy: str
    levels: tuple = ()
    below: int = 4
    window: int = 2
    above: int = 2
    max_users: int | None = None
    confirm: int = 1


def test_make_ramp_builds_each_strategy():
    assert make_ramp(Spec("explicit", levels=(1, 2)), None).planned() == [1, 2]
    assert isinstance(make_ramp(Spec("around-prediction"), 20.0), AroundPrediction)
    b = make_ramp(Spec("bisect", levels=(4, 64)), None)
    assert (b.lo, b.hi) == (4, 64)
    assert make_ramp(Spec("bisect"), 30.0).hi == 60
    assert make_ramp(Spec("bisect", max_users=10), 30.0).hi == 10


@pytest.mark.parametrize("spec,pred",
                         [(Spec("around-prediction"), None), (Spec("bisect"), None), (Spec("zigzag"), 3.0)])
def test_make_ramp_errors_are_config_errors(spec, pred):
    with pytest.raises(ConfigError):
        make_ramp(spec, pred)
