"""The rejection point on per-level figures: every level that waits
is in the plateau, the estimate is not biased by levels at the edge of saturation, and it comes
with an uncertainty the check uses."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvprobe.analysis.levels import LevelStats
from kvprobe.analysis.plateau import (
    SE_FLOOR,
    chi2_lower_5,
    deep_levels_to_add,
    deep_waiting,
    find_rejection_point,
    weighted_plateau,
)
from kvprobe.spec.expectation import Tolerances
from kvprobe.verdict.checks import check_no_preemption, check_rejection_point


def level(users, running, waiting, *, se=0.07, preemptions=0.0, usage=0.95, top=None):
    return LevelStats(users=users, running_mean=running, running_max=running, waiting_mean=waiting,
                      waiting_max=waiting if top is None else top, usage_mean=usage, usage_max=usage,
                      preemptions=preemptions, preemption_rate_per_s=0.0, samples=30, running_se=se)


# Real vLLM 0.33.0 (the shadow target), ledger 24.21: requests already wait at N=22 and 23 (0.94,
# 1.94); the levels just past the knee sit below the plateau, which is 24.1-24.2 deep in saturation.
# The mean over the levels the old hinge fit called saturated (N >= 24) is the 23.79 the issue saw.
ISSUE = [  # users, running, waiting, preemptions
    (6, 5.70, 0.03, 0), (12, 11.40, 0.06, 0), (18, 17.10, 0.12, 0), (20, 19.00, 0.20, 0), (21, 19.90, 0.35, 0),
    (22, 20.85, 0.94, 0), (23, 21.60, 1.94, 0), (24, 22.98, 2.30, 3), (25, 23.40, 2.60, 4), (26, 23.75, 3.00, 5),
    (27, 23.95, 3.40, 6), (28, 24.10, 4.00, 6), (30, 24.20, 5.60, 7), (32, 24.15, 7.50, 8),
]
LEDGER = 24.21
PRED = type("Prediction", (), {"limit": LEDGER, "no_preemption_limit": 22, "binding": "kv", "usage_at_limit": 0.96})


def issue_levels():
    return [level(u, r, w, preemptions=p) for u, r, w, p in ISSUE]


def test_the_old_average_of_the_waiting_levels_is_the_biased_figure_of_the_issue():
    old_plateau = [r for u, r, _w, _p in ISSUE if u >= 24]
    assert sum(old_plateau) / len(old_plateau) == pytest.approx(23.79, abs=0.01)


def test_finding_2_levels_that_already_wait_are_in_the_plateau_not_clean():
    rp = find_rejection_point(issue_levels())
    assert rp.onset_users == 22 and rp.saturated_levels[:2] == [22, 23]
    assert rp.transient_levels == []
    assert rp.last_clean_users == 21  # not 23: requests waited at 22
    res = check_no_preemption(PRED, rp, Tolerances())
    assert res.measured == 21 and "requests waited from N=22" in res.reason


def test_finding_3_the_plateau_is_the_deep_one_not_the_edge_average():
    rp = find_rejection_point(issue_levels())
    assert rp.plateau == pytest.approx(sum(r for u, r, _w, _p in ISSUE if u >= 22) / 9)  # the plain mean, biased
    assert rp.plateau < 23.3
    assert rp.rejection_point == pytest.approx(24.15, abs=0.06)  # the deep plateau, 24.1-24.2
    assert rp.deep_levels == [28, 30, 32] and rp.confirmed
    assert rp.weights[22] == 0 and rp.weights[23] == 0 and rp.weights[24] == 0 and rp.weights[30] == 1
    assert rp.uncertainty < 0.25
    # ... so the ledger's 24.21 passes at ±0.5, where the edge average (23.79) would not
    tight = Tolerances(rejection_point=0.5, rejection_point_relative=0.0)
    res = check_rejection_point(PRED, rp, tight, reported_agrees=True)
    assert res.passed, res.reason
    assert res.uncertainty == pytest.approx(rp.uncertainty, abs=0.01) and "±" in res.reason
    assert abs(23.79 - LEDGER) > 0.4


def test_an_undercounted_last_level_is_not_a_one_level_plateau():
    """Finding 1 + 2: the last level read low (streams cut at the stop counted as waiting) and
    alone looked saturated; one level cannot confirm a plateau, so the check cannot fail on it."""
    levels = [level(u, r, w) for u, r, w in [(6, 5.7, 0.0), (12, 11.4, 0.05), (18, 17.1, 0.1), (24, 22.8, 0.3),
                                             (25, 16.69, 8.3)]]
    rp = find_rejection_point(levels)
    assert rp.saturated_levels == [25] and not rp.confirmed
    res = check_rejection_point(PRED, rp, Tolerances(), reported_agrees=True)
    assert res.inconclusive and not res.passed and "rests on 1 deep level" in res.reason


def test_a_measurement_too_imprecise_for_the_tolerance_is_inconclusive_not_passed():
    noisy = [level(u, r, w, se=0.6) for u, r, w in
             [(10, 9.5, 0), (18, 17.0, 0.1), (28, 23.6, 4.5), (30, 24.7, 6.0), (32, 24.2, 8.0)]]
    rp = find_rejection_point(noisy)
    tight = Tolerances(rejection_point=0.5, rejection_point_relative=0.0)
    res = check_rejection_point(PRED, rp, tight, reported_agrees=True)
    assert abs(res.measured - LEDGER) <= 0.5 and rp.uncertainty > 0.5
    assert res.inconclusive and "straddles" in res.reason
    # ... while a prediction outside the tolerance even allowing for the uncertainty fails
    far = type("P", (), {**PRED.__dict__, "limit": 27.0})
    assert not check_rejection_point(far, rp, tight, reported_agrees=True).inconclusive


def test_weighted_plateau_scales_its_error_when_levels_disagree():
    est, half, scale = weighted_plateau([20.0, 20.1, 19.9], [1, 1, 1], [0.05, 0.05, 0.05])
    assert (est == pytest.approx(20.0) and scale == pytest.approx(2.0)
            and half == pytest.approx(1.96 * 0.0289 * 2, rel=0.02))
    est, half, scale = weighted_plateau([20.0, 20.01], [1, 1], [0.1, 0.1])
    assert scale < 1 and half == pytest.approx(1.96 * 0.1 / 2**0.5, rel=0.01)
    # no per-level errors: the scatter alone
    est, half, scale = weighted_plateau([20.0, 21.0], [1, 1], [None, None])
    assert est == pytest.approx(20.5) and scale is None and half == pytest.approx(1.96 * 0.5, rel=0.01)


# Eight deep levels of the emulated vLLM 0.33.0 at knee~24 (bench_ramps, predict held to ± 0.29, 2026-12-07):
# each level's batch means claimed 0.40-0.96, the levels agreed to 0.1
BENCH_DEEP = [24.25, 24.302, 24.081, 24.349, 24.21, 24.136, 24.074, 24.113]
BENCH_SE = [0.403, 0.553, 0.771, 0.657, 0.65, 0.782, 0.964, 0.919]


def test_levels_that_agree_better_than_their_errors_shrink_them_to_what_the_agreement_bounds():
    running, se = np.array(BENCH_DEEP), np.array(BENCH_SE)
    w = 1 / se**2
    propagated = 1.96 / np.sqrt(w.sum())
    chi2 = float(np.sum(w * (running - np.dot(w, running) / w.sum()) ** 2))
    est, half, scale = weighted_plateau(BENCH_DEEP, [1] * 8, BENCH_SE)
    assert scale == pytest.approx((chi2 / 7) ** 0.5) and scale < 0.25
    # the 95% upper bound of the true/claimed ratio, χ² over its 5% quantile at 7 degrees of freedom (2.1673)
    assert half == pytest.approx(propagated * (chi2 / 2.1673) ** 0.5, rel=1e-3) and half < propagated / 2
    # two levels as close are one degree of freedom: no evidence, the errors stand
    est, half, scale = weighted_plateau(BENCH_DEEP[:2], [1, 1], [0.553, 0.553])
    assert scale < 0.1 and half == pytest.approx(1.96 * 0.553 / 2**0.5, rel=1e-3)
    # identical levels shrink their errors only to the floor of a constant gauge, which more levels of the
    # same gauge do not narrow: the plateau's half-width stops there too
    est, half, scale = weighted_plateau([24.0] * 8, [1] * 8, [0.5] * 8)
    assert scale == 0 and half == pytest.approx(1.96 * SE_FLOOR)
    assert weighted_plateau([24.0] * 2, [1] * 2, [0.001] * 2)[1] == pytest.approx(1.96 * SE_FLOOR)


def test_the_chi2_quantile_is_the_distributions():
    # the regularized lower incomplete gamma function at the quantile is 5%, by its series
    for dof in (1, 2, 3, 7, 10, 11, 30):
        q, a = chi2_lower_5(dof), dof / 2
        term = total = 1 / a
        for n in range(1, 400):
            term *= (q / 2) / (a + n)
            total += term
        cdf = total * math.exp(-q / 2 + a * math.log(q / 2) - math.lgamma(a))
        assert cdf == pytest.approx(0.05, abs=0.002), dof


def test_deep_levels_are_planned_past_the_knee_and_the_deepest_level():
    assert deep_waiting(20) == 2.236 or deep_waiting(20) == pytest.approx(20**0.5 / 2)
    assert deep_waiting(4) == 2.0
    rp = find_rejection_point(issue_levels()[:-3])  # up to N=27: nothing deep yet
    assert not rp.deep_levels and not rp.confirmed
    added = deep_levels_to_add(rp, [u for u, *_ in ISSUE[:-3]], max_users=64)
    assert len(added) == 3 and added == sorted(added) and added[0] >= 28
    assert deep_levels_to_add(rp, [], max_users=added[0] - 1) == []  # max_users bounds it
    full = find_rejection_point(issue_levels())
    assert len(full.deep_levels) == 3
    assert deep_levels_to_add(full, [u for u, *_ in ISSUE], max_users=64) == []
    # an uncertainty above the precision asked for adds one more level, past the deepest
    more = deep_levels_to_add(full, [u for u, *_ in ISSUE], max_users=64, precision=0.01)
    assert len(more) == 1 and more[0] > 32


# The SGLang shadow (0.5.23, ledger 21, clean predicted up to 21) in a CI run of stop 30: running and
# waiting from the streams (its gauges are sampled), the queue gauge's highest reading beside them.
# N=20 read 0.51 waiting from the streams while the engine's gauge never saw a queue there.
SGLANG_CI = [(10, 10.00, 0.00, 0.0), (20, 19.48, 0.51, 0.0), (26, 20.92, 5.08, 9.0), (29, 20.89, 8.11, 12.0)]
SGLANG_PRED = type("Prediction", (), {"limit": 21.0, "no_preemption_limit": 21, "binding": "kv",
                                      "usage_at_limit": 0.81})


@pytest.mark.parametrize(("gauge_at_20", "clean"), [(0.0, 20), (1.0, 10), (float("nan"), 10)])
def test_the_streams_waiting_counts_only_where_the_queue_gauge_saw_a_queue(gauge_at_20, clean):
    """The streams' waiting below the knee is the client-to-scheduler way when the engine's queue
    gauge read zero throughout (plateau.queue_seen); where it read a request, or there is no gauge,
    the streams decide."""
    levels = [level(u, r, w, top=gauge_at_20 if u == 20 else top) for u, r, w, top in SGLANG_CI]
    rp = find_rejection_point(levels)
    assert rp.last_clean_users == clean
    assert check_no_preemption(SGLANG_PRED, rp, Tolerances()).passed is (clean == 20)


# tests/hardening/test_faults.py's three-level ramp on the vLLM emulator without /metrics (the streams
# count running and waiting), as a quiet machine measures it: 10, 20 below the limit of 20.24, 28 past it.
QUIET_SHORT_RAMP = [(10, 9.41, 0.59), (20, 18.72, 1.28), (28, 20.93, 7.07)]


@pytest.mark.parametrize("running_10, waiting_10", [
    (9.41, 0.59),  # as measured on a quiet machine
    (7.5, 0.6),    # the first level read low (a busy machine lengthened the client's turn between requests)
    (9.0, 2.5),    # its requests waited long for a first token (the engine's cores were busy)
], ids=["quiet", "first-level-low", "first-token-slow"])
def test_one_busy_first_level_does_not_hide_the_plateau(running_10, waiting_10):
    """Both busy readings once read as "no level saturated" (CI, stop 43): the hinge fit bent its line
    to the low level, or the step queueing read off level 10 (×28) took all of N=28's queue."""
    levels = [level(10, running_10, waiting_10, top=float("nan"))] + [
        level(u, r, w, top=float("nan")) for u, r, w in QUIET_SHORT_RAMP[1:]]
    rp = find_rejection_point(levels)
    assert rp.saturated_levels == [28] and rp.onset_users == 28
    assert rp.rejection_point == pytest.approx(20.93)
    assert 0.85 < rp.follow < 0.95  # the line through the two levels that wait for nobody
