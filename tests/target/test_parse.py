"""parse_sample against real engine /metrics text and against the edge cases around it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvprobe.engines.base import MetricMap
from kvprobe.observe.sampler import Sample, TimeSeries, parse_sample
from tests.engine_fixtures import fixture_text

from .conftest import SGLANG_MAP, VLLM_MAP


def test_vllm_busy_fixture():
    s = parse_sample(fixture_text("vllm-0.33.0-metrics.txt"), VLLM_MAP, 1.0)
    assert s.ok and s.error is None
    assert (s.running, s.waiting, s.waiting_capacity, s.preemptions) == (22, 3, 3, 55)
    assert s.usage == pytest.approx(0.9709190672153635)
    assert s.used_tokens is None  # vLLM exports no used-tokens gauge: unknown, not 0
    assert s.t == 1.0


def test_vllm_drained_and_idle_fixtures():
    s = parse_sample(fixture_text("vllm-0.33.0-metrics-drained.txt"), VLLM_MAP, 0.0)
    assert (s.ok, s.running, s.waiting, s.usage, s.waiting_capacity) == (True, 0, 0, 0, 0)
    assert s.preemptions == 57  # counters stay after the drain
    idle = parse_sample(fixture_text("vllm-0.33.0-metrics-idle.txt"), VLLM_MAP, 0.0)
    assert (idle.ok, idle.running, idle.waiting, idle.usage, idle.preemptions) == (True, 0, 0, 0, 0)


def test_sglang_busy_fixture():
    s = parse_sample(fixture_text("sglang-0.5.23-metrics.txt"), SGLANG_MAP, 0.0)
    assert s.ok
    assert (s.running, s.waiting, s.usage, s.used_tokens) == (144, 56, 0.82, 366267)
    # The multiprocess collector shows no retraction counter before the first retraction:
    # that is "not exported", None, not a made-up 0.
    assert s.preemptions is None
    assert s.waiting_capacity is None


def test_sglang_retraction_counter_with_labels_and_pid():
    base = fixture_text("sglang-0.5.23-metrics.txt")
    labels = 'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    extra = (
        "# HELP sglang:num_retracted_requests_total Number of retracted requests.\n"
        "# TYPE sglang:num_retracted_requests_total counter\n"
        f'sglang:num_retracted_requests_total{{{labels},pid="11"}} 4.0\n'
        f'sglang:num_retracted_requests_total{{{labels},pid="12"}} 3.0\n'
    )
    s = parse_sample(base + extra, SGLANG_MAP, 0.0)
    assert s.preemptions == 7  # summed over the extra `pid` label


def test_sglang_docs_sample_older_version():
    s = parse_sample(fixture_text("sglang-docs-metrics-sample.txt"), SGLANG_MAP, 0.0)
    assert (s.ok, s.running, s.waiting, s.usage, s.used_tokens) == (True, 162, 2826, 0.28, 123859)


@pytest.mark.parametrize("name", ["vllm:num_preemptions", "vllm:num_preemptions_total"])
def test_total_suffix_either_way_in_the_map(name):
    m = MetricMap(running=VLLM_MAP.running, waiting=VLLM_MAP.waiting, usage=VLLM_MAP.usage, preemptions=name)
    assert parse_sample(fixture_text("vllm-0.33.0-metrics.txt"), m, 0.0).preemptions == 55


def test_untyped_total_and_created_series():
    text = (
        "vllm:num_requests_running 2\n"
        "vllm:num_requests_waiting 0\n"
        "vllm:num_preemptions_total 9\n"
        "vllm:num_preemptions_created 1.7e9\n"
    )
    s = parse_sample(text, VLLM_MAP, 0.0)
    assert (s.ok, s.running, s.preemptions) == (True, 2, 9)


def test_extra_labels_sum_counts_and_average_usage():
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="a"} 3\n'
        'vllm:num_requests_running{engine="1",model_name="a"} 4\n'
        'vllm:num_requests_waiting{engine="0"} 1\n'
        'vllm:num_requests_waiting{engine="1"} 2\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 1\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="deferred"} 5\n'
        'vllm:num_requests_waiting_by_reason{engine="1",reason="capacity"} 2\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.7\n'
    )
    s = parse_sample(text, VLLM_MAP, 0.0)
    assert (s.running, s.waiting, s.waiting_capacity) == (7, 3, 3)
    assert s.usage == pytest.approx(0.6)
    assert s.preemptions is None


def test_usage_fallback_name_and_missing_usage():
    text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.25\n"
    assert parse_sample(text, VLLM_MAP, 0.0).usage == 0.25
    s = parse_sample("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n", VLLM_MAP, 0.0)
    assert s.ok and s.usage is None


def test_nan_series_are_ignored():
    text = "sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\nsglang:token_usage NaN\n"
    s = parse_sample(text, SGLANG_MAP, 0.0)
    assert s.ok and s.usage is None


@pytest.mark.parametrize("text", [
    "<html><body>502 Bad Gateway</body></html>",
    "vllm:num_requests_running{engine=0} 1\n",
    "vllm:num_requests_running one\n",
    "\x00\x01\x02",
])
def test_garbage_is_a_failed_sample(text):
    s = parse_sample(text, VLLM_MAP, 5.0)
    assert not s.ok and s.error and s.t == 5.0
    assert s.running is None


def test_valid_text_without_the_engine_metrics_is_a_failed_sample():
    s = parse_sample("python_gc_objects_collected_total 12\n", VLLM_MAP, 0.0)
    assert not s.ok
    assert "vllm:num_requests_running" in s.error and "vllm:num_requests_waiting" in s.error
    s = parse_sample("", VLLM_MAP, 0.0)
    assert not s.ok


def test_arrays_and_jsonl_round_trip(tmp_path):
    series = TimeSeries([
        Sample(t=1.0, ok=True, running=2, waiting=0, usage=0.5, preemptions=1),
        Sample(t=1.1, ok=False, error="GET x: HTTP 404"),
        Sample(t=1.2, ok=True, running=3, waiting=1, waiting_capacity=1, usage=math.nan, used_tokens=10),
    ])
    arrs = series.arrays()
    assert set(arrs) == {"t", "running", "waiting", "waiting_capacity", "usage", "preemptions", "used_tokens", "ok"}
    assert arrs["ok"].dtype == bool and list(arrs["ok"]) == [True, False, True]
    np.testing.assert_array_equal(arrs["running"], [2, np.nan, 3])
    assert np.isnan(arrs["usage"][2]) and np.isnan(arrs["waiting_capacity"][0])
    path = tmp_path / "series.jsonl"
    series.to_jsonl(path)
    back = TimeSeries.from_jsonl(path)
    assert len(back) == 3 and back.samples[1].error == "GET x: HTTP 404"
    for key, arr in back.arrays().items():
        np.testing.assert_array_equal(arr, arrs[key])


def test_dialect_metric_maps_read_the_fixtures():
    engines = pytest.importorskip("kvprobe.engines")
    if not hasattr(engines, "get_dialect"):
        pytest.skip("kvprobe.engines.get_dialect not there yet")
    vllm = parse_sample(fixture_text("vllm-0.33.0-metrics.txt"), engines.get_dialect("vllm").METRICS, 0.0)
    assert (vllm.running, vllm.waiting, vllm.preemptions) == (22, 3, 55)
    assert vllm.usage == pytest.approx(0.9709190672153635)
    sgl = parse_sample(fixture_text("sglang-0.5.23-metrics.txt"), engines.get_dialect("sglang").METRICS, 0.0)
    assert (sgl.running, sgl.waiting, sgl.usage) == (144, 56, 0.82)
