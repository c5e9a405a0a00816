"""The Sampler thread against real HTTP servers whose /metrics change, vanish and fail."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from kvprobe.observe.sampler import Sampler, scrape_once
from tests.engine_fixtures import fixture_text

from .conftest import VLLM_MAP, wait_until


@pytest.fixture
def prom_server():
    """prometheus_client's own exposition server over a private registry, in vLLM's names."""
    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    metrics = {
        "running": Gauge("vllm:num_requests_running", "running", labels, registry=registry),
        "waiting": Gauge("vllm:num_requests_waiting", "waiting", labels, registry=registry),
        "by_reason": Gauge("vllm:num_requests_waiting_by_reason", "w", [*labels, "reason"], registry=registry),
        "usage": Gauge("vllm:kv_cache_usage_perc", "usage", labels, registry=registry),
        "preemptions": Counter("vllm:num_preemptions", "preemptions", labels, registry=registry),
    }
    for name in ("running", "waiting", "usage"):
        metrics[name].labels("0", "m").set(0)
    metrics["preemptions"].labels("0", "m")
    httpd, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    yield f"http://127.0.0.1:{httpd.server_address[1]}", metrics
    httpd.shutdown()
    httpd.server_close()


def test_scrape_once_reads_prometheus_client_exposition(prom_server):
    url, m = prom_server
    m["running"].labels("0", "m").set(4)
    m["by_reason"].labels("0", "m", "capacity").set(2)
    m["by_reason"].labels("0", "m", "deferred").set(1)
    m["preemptions"].labels("0", "m").inc(3)
    text, s = scrape_once(url, VLLM_MAP)
    assert "vllm:num_preemptions_created" in text  # the default exposition adds _created series
    assert (s.ok, s.running, s.waiting, s.waiting_capacity, s.preemptions) == (True, 4, 0, 2, 3)


def test_sampler_follows_values_changed_while_sampling(prom_server):
    url, m = prom_server
    sampler = Sampler(url, VLLM_MAP, interval=0.02).start()
    try:
        for running, usage in [(1, 0.1), (7, 0.6), (3, 0.2)]:
            m["running"].labels("0", "m").set(running)
            m["usage"].labels("0", "m").set(usage)
            got = sampler.wait_for(lambda s, r=running: s.running == r, timeout=5.0)
            assert got is not None, f"sampler never saw running={running}"
            assert got.ok
        m["preemptions"].labels("0", "m").inc(5)
        assert sampler.wait_for(lambda s: s.preemptions == 5, timeout=5.0) is not None
    finally:
        series = sampler.stop()
    assert not sampler.running()
    arrs = series.arrays()
    assert arrs["ok"].all()
    assert np.all(np.diff(arrs["t"]) > 0)
    # the values appear in the order they were set
    seen = [int(v) for v in arrs["running"]]
    firsts = [seen.index(v) for v in (1, 7, 3)]
    assert firsts == sorted(firsts)


def test_sampling_rate_is_near_the_interval(metrics_server):
    metrics_server.body = fixture_text("vllm-0.33.0-metrics.txt").encode()
    sampler = Sampler(metrics_server.url, VLLM_MAP, interval=0.05).start()
    t0 = time.monotonic()
    try:
        assert wait_until(lambda: len(sampler.series) >= 20, timeout=10.0)
    finally:
        series = sampler.stop()
    elapsed = time.monotonic() - t0
    rate_ratio = len(series) * 0.05 / elapsed  # 1.0 = exactly on the grid
    assert 0.5 < rate_ratio <= 1.3
    t = series.arrays()["t"]
    assert np.median(np.diff(t)) == pytest.approx(0.05, rel=0.5)


def test_metrics_that_disappear_then_fail_stay_visible(metrics_server):
    full = fixture_text("vllm-0.33.0-metrics.txt")
    metrics_server.body = full.encode()
    sampler = Sampler(metrics_server.url, VLLM_MAP, interval=0.02, timeout=1.0).start()
    try:
        assert sampler.wait_for(lambda s: s.ok and s.running == 22, 5.0)
        # the engine stops exporting its scheduler gauges (e.g. SGLang before its idle report)
        partial = "\n".join(line for line in full.splitlines() if "num_requests_" not in line)
        metrics_server.body = partial.encode()
        assert sampler.wait_for(lambda s: not s.ok and "missing metrics" in (s.error or ""), 5.0)
        metrics_server.body = b"<html>oops</html>"
        assert sampler.wait_for(lambda s: not s.ok and "unparseable" in (s.error or ""), 5.0)
        metrics_server.status = 404
        assert sampler.wait_for(lambda s: not s.ok and "HTTP 404" in (s.error or ""), 5.0)
        metrics_server.status, metrics_server.body = 200, full.encode()
        assert sampler.wait_for(lambda s: s.ok and s.running == 22, 5.0)
        assert sampler.running()  # none of it killed the thread
    finally:
        series = sampler.stop()
    arrs = series.arrays()
    bad = ~arrs["ok"]
    assert bad.any() and arrs["ok"].any()
    assert np.isnan(arrs["running"][bad]).all() or np.isnan(arrs["waiting"][bad]).all()


def test_missing_metrics_endpoint_from_the_start(metrics_server):
    metrics_server.status = 404
    sampler = Sampler(metrics_server.url + "/metrics", VLLM_MAP, interval=0.02).start()
    try:
        assert wait_until(lambda: len(sampler.series) >= 3, timeout=5.0)
    finally:
        series = sampler.stop()
    assert not any(s.ok for s in series.samples)
    assert all("HTTP 404" in s.error for s in series.samples)


def test_server_gone_is_recorded_not_raised():
    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sampler = Sampler(f"http://127.0.0.1:{port}", VLLM_MAP, interval=0.02, timeout=0.5).start()
    try:
        assert wait_until(lambda: len(sampler.series) >= 3, timeout=5.0)
    finally:
        series = sampler.stop()
    assert all(not s.ok and "Connection" in s.error for s in series.samples)


def test_stop_is_bounded_when_the_server_hangs(metrics_server):
    metrics_server.body = fixture_text("vllm-0.33.0-metrics.txt").encode()
    metrics_server.delay = 3.0
    sampler = Sampler(metrics_server.url, VLLM_MAP, interval=0.05, timeout=0.3).start()
    try:
        failed = sampler.wait_for(lambda s: not s.ok, timeout=5.0)
        assert failed is not None and "timed out" in failed.error.lower()
    finally:
        t0 = time.monotonic()
        sampler.stop()
        stop_s = time.monotonic() - t0
    assert stop_s < 2 * 0.3 + 0.05 + 1.0 + 0.5
    assert not sampler.running()


def test_headers_are_sent_and_never_shown(metrics_server):
    metrics_server.body = fixture_text("vllm-0.33.0-metrics.txt").encode()
    secret = "sk-sampler-secret-7f3a"
    sampler = Sampler(metrics_server.url, VLLM_MAP, interval=0.02, headers={"Authorization": f"Bearer {secret}"})
    with sampler:
        assert sampler.wait_for(lambda s: s.ok, 5.0)
    assert metrics_server.seen_headers[0].get("Authorization") == f"Bearer {secret}"
    assert secret not in repr(sampler) and secret not in str(sampler)
    assert all(secret not in repr(s) for s in sampler.series.samples)


def test_sampler_thread_is_a_plain_thread(metrics_server):
    metrics_server.body = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
    sampler = Sampler(metrics_server.url, VLLM_MAP, interval=0.02).start()
    try:
        assert sampler.wait_for(lambda s: s.ok, 5.0)
        names = [t.name for t in threading.enumerate()]
        assert "kvprobe-sampler" in names
    finally:
        sampler.stop()
    assert "kvprobe-sampler" not in [t.name for t in threading.enumerate()]
