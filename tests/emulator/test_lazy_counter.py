"""The emulator's SGLang retraction counter appears at the first retraction, as SGLang's does
(observability/metrics_collector.py L557-562: a labelled Counter whose child `.labels(...).inc(n)`
creates at L1519), so a probe can be seen to show it as absent rather than 0."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvprobe.engines import sglang
from kvprobe.observe.sampler import parse_sample
from kvprobe.targets.emulator.metrics import TRUE_RUNNING, SglangMetrics, Snapshot


def families(metrics: SglangMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}


def snapshot(retracted: int) -> Snapshot:
    return Snapshot(running=20, waiting=3, usage=0.8, used_tokens=2600, pool_tokens=3300,
                    preemptions_total=retracted)


def test_the_retraction_counter_is_absent_until_the_first_retraction():
    m = SglangMetrics("m", max_total_num_tokens=3300, context_len=2048, page_size=1)
    m.publish(snapshot(0))
    fams = families(m)
    assert "sglang:num_retracted_requests" not in fams and "sglang:num_retracted_reqs" in fams
    assert parse_sample(m.exposition().decode(), sglang.METRICS, 0.0).preemptions is None  # absent, not 0
    m.publish(snapshot(2))
    assert parse_sample(m.exposition().decode(), sglang.METRICS, 1.0).preemptions == 2.0


def test_the_true_running_count_is_published_every_step():
    m = SglangMetrics("m", max_total_num_tokens=3300, context_len=2048, page_size=1)
    m.on_step(snapshot(0), prefill_tokens=0, decode_seqs=20, emitted=20, now=0.0)  # no report at this step
    fams = families(m)
    assert fams[TRUE_RUNNING].samples[0].value == 20
    assert fams[sglang.METRICS.running].samples[0].value == 0  # the engine's own gauge waits for a report
