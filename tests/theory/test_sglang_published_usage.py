"""The usage gauge the ledger predicts for SGLang is the one SGLang publishes.

The reference is the real SGLang 0.5.23, run as a shadow target on this machine (its own scheduler
and metrics code, a model-less forward): `kvprobe probe` of each shape below read the
sglang:token_usage means on its saturated levels given here. The issue's shape is probed again by
tests/shadow_sglang/test_usage_gauge.py."""

from __future__ import annotations

import pytest

from kvprobe.theory.schedsim import SglangConfig
from kvprobe.theory.sglang.admission import predict_sglang
from kvprobe.theory.sglang.reports import reported_growth, sglang_published_usage

# (max-total-tokens, P, O) -> the real shadow's usage gauge on its saturated levels
REAL = {
    (3300, 512, 128): (0.853, 0.860),  # the issue's shape (5 running): 85.4-86.0%
    (3300, 128, 32): (0.843, 0.864),  # expectations/emulated-sglang.yaml's shape (20 running): 84.3-86.4%
    (16384, 512, 256): (0.789, 0.807),  # expectations/shadow-sglang.yaml shadow-sglang-kv (21 running): 78.9-80.7%
}


@pytest.mark.parametrize("shape", list(REAL))
@pytest.mark.parametrize("radix", [True, False])
def test_the_ledgers_gauge_is_what_real_sglang_showed(shape, radix):
    M, P, O = shape  # noqa: E741
    cfg = SglangConfig(max_total_num_tokens=M, context_len=2048, disable_radix_cache=not radix)
    prediction = predict_sglang(cfg, P, O, 0, "sglang-0.5.22")
    low, high = REAL[shape]
    assert low - 0.015 <= prediction.usage_at_limit <= high + 0.015, (prediction.usage_at_limit, REAL[shape])


def test_the_issues_shape():
    # before: prefill reports were read as if the finished request's replacement were not yet
    # allocated (R - 1 held) and every report weighed alike: 0.77 against the engine's 0.859
    assert sglang_published_usage(5, 512, 128, 3300) == 0.86


def test_reported_growth_is_the_gauges_rise_over_the_prefill_reading():
    assert reported_growth(0, 40) == 0
    # shorter than the interval: a report came with probability x / 40, at a uniform step before x
    assert reported_growth(20, 40) == pytest.approx(sum(x * x / 80 for x in range(20)) + 20 ** 2 / 160, rel=0.05)
    # far longer: the gauge trails the pool by half an interval on average
    d = 4000
    assert reported_growth(d, 40) == pytest.approx(d * d / 2 - 20 * d, rel=0.001)
    assert reported_growth(40, 40) == pytest.approx(40 ** 2 / 6)  # both branches meet
