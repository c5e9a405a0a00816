"""The ramp that spends the prediction (kvprobe.probe.strategy): where its levels go when the
prediction holds, when it is wrong by a factor of two either way, and when its verdict is settled."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvprobe.analysis.plateau import RejectionPoint, deep_waiting
from kvprobe.analysis.steady import detected_start, fed_since, mser_truncation
from kvprobe.errors import ConfigError
from kvprobe.load.ramps import LevelResult
from kvprobe.probe.strategy import (
    MAX_LEVELS,
    SAFE_SHARE,
    PredictRamp,
    deep_users,
    fed,
    make_ramp,
    settled,
    usage_agrees,
    widest,
)
from kvprobe.spec.schema import RampSpec


def engine(limit: float, follow: float = 0.95):
    """A closed-loop engine in the fluid limit: running min(follow x N, limit), the rest waiting."""
    def level(n: int) -> LevelResult:
        running = min(follow * n, limit)
        waiting = max(0.0, follow * n - limit)
        return LevelResult(n, running, waiting, 0.0, saturated=waiting >= max(1.0, 0.1 * n))
    return level


def walk(ramp, level, most: int = 12) -> list[int]:
    history = []
    while (n := ramp.next_level(history)) is not None and len(history) < most:
        history.append(level(n))
    return [h.users for h in history]


def test_a_right_prediction_runs_one_low_level_then_two_deep_ones():
    levels = walk(PredictRamp(24.0), engine(24.0))
    assert levels == [12, deep_users(24.0), deep_users(24.0) + math.ceil(deep_waiting(24.0))]
    # deep: each keeps a queue of at least D = deep_waiting(24) past the knee
    for n in levels[1:]:
        assert (0.95 * n - 24.0) / 0.95 >= deep_waiting(24.0)


def test_no_preemption_adds_the_lowest_clean_level_that_passes_it():
    # 19 is near the knee: its queue is judged beyond step queueing, which half the limit reads
    levels = walk(PredictRamp(24.0, clean_limit=20, tolerance=1.0), engine(24.0))
    assert levels[:2] == [12, 19] and len(levels) == 4
    # a clean level well below the knee (a long output that preempts: 7 clean, 13 running) reads both
    levels = walk(PredictRamp(13.24, clean_limit=7, tolerance=1.0), engine(13.24))
    assert levels[0] == 6 and len(levels) == 3


def test_a_prediction_twice_too_high_places_the_rest_from_the_measurement():
    ramp = PredictRamp(48.0)
    levels = walk(ramp, engine(24.0))
    assert levels[0] == 24 and levels[1] == deep_users(48.0)
    assert "ran 24.0 where 48 was predicted" in ramp.note and "doubling" not in ramp.note
    assert 12 in levels  # a level below the measured knee, for the hinge fit
    assert len(levels) <= 5


def test_a_prediction_twice_too_low_searches_by_doubling_from_the_first_deep_level():
    ramp = PredictRamp(12.0)
    levels = walk(ramp, engine(24.0))
    first = deep_users(12.0)
    assert levels[:2] == [6, first] and levels[2] == 2 * first
    assert ramp.note.startswith(f"N={first} did not saturate") and "placed from the measurement" in ramp.note
    deep = [n for n in levels if (0.95 * n - 24.0) / 0.95 >= deep_waiting(24.0)]
    assert len(deep) >= 2, levels


def test_max_users_stops_the_ramp():
    assert walk(PredictRamp(40.0, max_users=32), engine(40.0)) == [20]  # the first deep level is 48


def test_the_strategy_needs_a_prediction():
    with pytest.raises(ConfigError, match="predicted"):
        PredictRamp(float("nan"))
    with pytest.raises(ConfigError, match="predicted"):
        make_ramp(RampSpec("predict"), None)


def rejection(point, half, confirmed=True):
    return RejectionPoint(point, None, point, [], None, uncertainty=half, confirmed=confirmed)


@pytest.mark.parametrize(("point", "half", "done"), [
    (24.1, 0.3, True),    # inside the tolerance, even at the interval's edge
    (25.0, 0.3, False),   # the interval straddles the tolerance's edge: another deep level
    (24.0, 0.9, False),   # inside, but wider than half the allowance
    (27.0, 0.5, True),    # wholly outside: the verdict is a FAIL whatever more data says
    (27.0, 0.9, False),   # outside, but wider than the settled share
    (25.0, 0.05, True),
])
def test_a_verdict_is_settled_when_its_interval_is_wholly_inside_or_outside(point, half, done):
    assert settled(rejection(point, half), 24.0, 1.2) is done


def test_a_profile_may_ask_for_a_narrower_verdict_than_a_safe_one():
    assert settled(rejection(24.1, 0.3), 24.0, 1.2, 0.5)
    assert not settled(rejection(24.1, 0.3), 24.0, 1.2, 0.25)  # ramp.uncertainty: 0.25
    assert not settled(rejection(24.0, 0.9), 24.0, 1.2, 5.0)  # never wider than a safe verdict allows
    assert widest(1.2) == widest(1.2, 5.0) == pytest.approx(SAFE_SHARE * 1.2) and widest(1.2, 0.25) == 0.25


def test_the_ramp_reads_the_profiles_uncertainty():
    from types import SimpleNamespace

    from kvprobe.probe import ramp

    profile = SimpleNamespace(ramp=RampSpec("predict", uncertainty=0.25))
    pr = SimpleNamespace(prediction=SimpleNamespace(limit=24.0), exp=SimpleNamespace(profile=profile))
    assert not ramp._settled(pr, rejection(24.1, 0.3), 1.2)
    profile.ramp = RampSpec("predict")
    assert ramp._settled(pr, rejection(24.1, 0.3), 1.2)


def test_a_ramp_that_ends_wider_than_asked_says_so(monkeypatch):
    from types import SimpleNamespace

    from kvprobe.probe import ramp

    monkeypatch.setattr(ramp, "_plan_rejection", lambda pr: rejection(24.1, 0.31))
    strategy = PredictRamp(24.0)
    profile = SimpleNamespace(ramp=RampSpec("predict", uncertainty=0.25))
    pr = SimpleNamespace(exp=SimpleNamespace(profile=profile), dialect=SimpleNamespace(RUNNING_GAUGE_EXACT=True),
                         result=SimpleNamespace(levels=[None] * 7))
    ramp._short_of_target(pr, strategy)
    assert strategy.note == "the plateau's ± 0.31 is wider than the profile's uncertainty 0.25 after 7 levels"
    strategy.note, profile.ramp = None, RampSpec("predict", uncertainty=0.35)
    ramp._short_of_target(pr, strategy)
    assert strategy.note is None


def test_an_unconfirmed_plateau_is_never_settled():
    assert not settled(rejection(24.0, 0.1, confirmed=False), 24.0, 1.2)


def gauge(users: int, usage: float):
    """A level as the usage gauge read it (the only figures usage_agrees reads)."""
    return type("Level", (), {"users": users, "usage_mean": usage})()


@pytest.mark.parametrize("readings, agree", [
    ({37: 0.907, 40: 0.974}, False),  # two deep levels 6.7 points apart: their median would be the low one
    ({37: 0.95, 40: 0.974}, True),    # within the check's 5 points
    ({37: 0.907, 40: 0.974, 43: 0.97}, True),  # three: the median no longer rests on one level
    ({37: float("nan"), 40: float("nan")}, True),  # no gauge: nothing to settle
    ({40: 0.974}, True),
])
def test_the_usage_gauge_is_read_once_the_deep_levels_agree_on_it(readings, agree):
    levels = [gauge(15, 0.46)] + [gauge(n, u) for n, u in readings.items()]  # N=15 is below the knee
    assert usage_agrees(levels, list(readings), 0.05) is agree


def test_mser_finds_the_end_of_a_climb_and_nothing_in_a_steady_series():
    rng = np.random.default_rng(0)
    steady = 24 + rng.normal(0, 0.3, 60)
    assert mser_truncation(steady) <= 10
    climb = np.concatenate([np.linspace(5, 24, 15), 24 + rng.normal(0, 0.3, 45)])
    cut = mser_truncation(climb)
    assert 10 <= cut <= 20, cut
    t = np.arange(60) * 0.1
    assert detected_start(t, [climb, np.zeros(60)], 0.0, 6.0) == pytest.approx(t[cut])
    assert mser_truncation(climb[:15]) == 0  # fewer than four batches: nothing to compare


def test_the_plan_never_repeats_a_level_and_stops_after_max_levels():
    # a level the load generator reports as reached at its first arrival would hold no time when
    # repeated (the 'predicted x0.5' bench shape ran 2098 zero-length levels of N=35): here only
    # N=32 saturates, so "one deep level more" keeps finding the level after it unsaturated
    def flaky(n: int) -> LevelResult:
        if n == 32:
            return LevelResult(n, 24.0, 6.4, 0.0, saturated=True)
        return LevelResult(n, 0.95 * n, 0.0, 0.0, saturated=False)
    levels = walk(PredictRamp(12.0), flaky, most=50)
    assert len(levels) == len(set(levels)), levels
    assert len(levels) <= MAX_LEVELS


def test_a_deep_level_the_load_did_not_reach_refutes_nothing():
    # the bench's 'knee~100' and 'sglang knee~50' shapes: Locust's loop starved, the first deep
    # level read running 0-3.5 with no queue, and the plan placed every later level from it
    true = engine(100.0)
    first = deep_users(100.0)

    def starved_once(n: int) -> LevelResult:
        return LevelResult(n, 0.0, 0.0, 0.0, saturated=True) if n == first else true(n)
    ramp = PredictRamp(100.0)
    levels = walk(ramp, starved_once)
    step = math.ceil(deep_waiting(100.0))
    assert levels[:3] == [50, first, first + step], levels
    assert "was predicted" not in (ramp.note or "") and ramp.note.count("did not reach") == 1
    assert not fed(starved_once(first)) and fed(true(first + step))


def test_a_level_is_fed_once_the_engine_holds_half_its_users():
    t = np.arange(40) * 0.1
    running = np.concatenate([np.zeros(15), np.full(25, 30.0)])
    waiting = np.concatenate([np.zeros(15), np.full(25, 10.0)])
    assert fed_since(t, running, waiting, 0.0, 4.0, 0.5 * 60) == pytest.approx(t[15])
    assert fed_since(t, running, waiting, 0.0, 1.4, 0.5 * 60) is None  # still spawning: not steady yet
    # a flat zero is steady to MSER: the fed time, not the detected start, bounds the window
    assert detected_start(t, [running, waiting], 0.0, 1.4) == 0.0


def test_deep_levels_without_a_queue_do_not_end_the_plan():
    # the bench's 'knee~24' on a busy machine: N=30 and 33 ran at the limit with no queue in the
    # engine (Locust's loop held it), the plan stopped, and the plateau had no deep level at all
    true = engine(24.0)

    def starved(n: int) -> LevelResult:
        level = true(n)
        return LevelResult(n, 24.0, 0.3, 0.0, saturated=True) if n in (30, 33) else level
    levels = walk(PredictRamp(24.0, clean_limit=20), starved)
    assert levels[:4] == [12, 19, 30, 33] and len(levels) >= 6, levels
    assert sum(1 for n in levels if true(n).waiting >= deep_waiting(24.0)) >= 2


def test_a_deep_level_held_back_by_the_load_generator_refutes_nothing():
    # the bench's 'knee~58' on a busy machine: N=69 ran 37.6 with no queue in the engine, and the
    # plan placed every later level from 37.6 (10 levels, ± 7.3)
    true = engine(58.5)
    first = deep_users(58.5)

    def held(n: int) -> LevelResult:
        return LevelResult(n, 37.6, 0.3, 0.0, saturated=True) if n == first else true(n)
    ramp = PredictRamp(58.5)
    levels = walk(ramp, held)
    assert "was predicted" not in (ramp.note or "") and f"N={first} ran 37.6 with no queue" in ramp.note
    assert levels[:3] == [29, first, first + math.ceil(deep_waiting(58.5))] and len(levels) == 4, levels


def _below_knee(waiting: float, se: float | None, preemptions: float | None = 0.0, top: float | None = None):
    from types import SimpleNamespace
    return SimpleNamespace(waiting_mean=waiting, waiting_se=se, preemptions=preemptions,
                           waiting_max=waiting if top is None else top)  # the gauge's highest reading


@pytest.mark.parametrize(("waiting", "se", "preemptions", "decided"), [
    (0.05, 0.02, 0.0, True),     # clean beyond doubt
    (1.40, 0.20, 0.0, True),     # it waits beyond doubt
    (0.45, 0.10, 0.0, False),    # 0.25-0.65: on the threshold (the vLLM shadow's N=23 over one lifetime)
    (0.30, 0.15, 0.0, False),    # 0.01-0.59: still on it
    (0.30, None, 0.0, False),    # too few samples for an interval
    (0.45, 0.10, 3.0, True),     # it preempted: not clean, whatever it waited
    (float("nan"), None, 0.0, True),  # no queue gauge: holding reads nothing more
])
def test_the_clean_level_is_held_until_its_waiting_is_decided(waiting, se, preemptions, decided):
    from kvprobe.probe.ramp import _clean_decided
    assert _clean_decided(_below_knee(waiting, se, preemptions), exact_gauge=True) is decided


@pytest.mark.parametrize(("waiting", "se", "top", "decided"), [
    (0.0, 0.0, 0.0, True),       # the gauge read no queue: clean, as the judgement reads it (plateau.queue_seen)
    (0.05, 0.02, 1.0, False),    # it read one: the streams may read more, known only after the ramp
    (1.40, 0.20, 4.0, True),     # its low reading already waits beyond doubt
    (0.45, 0.10, 2.0, False),
])
def test_a_sampled_gauges_clean_level_is_decided_by_whether_it_saw_a_queue(waiting, se, top, decided):
    from kvprobe.probe.ramp import _clean_decided
    assert _clean_decided(_below_knee(waiting, se, top=top), exact_gauge=False) is decided


def test_a_levels_waiting_has_a_standard_error():
    from kvprobe.analysis.levels import LevelWindow, level_stats
    t = np.arange(0.0, 10.0, 0.1)
    waiting = np.where((t % 2.0) < 0.4, 2.0, 0.0)  # a burst that queues two for a fifth of each 2 s
    arrays = {"t": t, "running": np.full_like(t, 20.0), "waiting": waiting, "usage": np.full_like(t, 0.8)}
    lv = level_stats(arrays, [LevelWindow(users=22, t_start=0.0, t_end=10.0)], warmup_fraction=0.0)[0]
    assert lv.waiting_mean == pytest.approx(0.4, abs=0.05)
    assert lv.waiting_se is not None and 0.0 < lv.waiting_se < 0.2, lv.waiting_se
    steady = level_stats({**arrays, "waiting": np.zeros_like(t)}, [LevelWindow(22, 0.0, 10.0)], warmup_fraction=0.0)[0]
    assert steady.waiting_se == 0.0
