"""Shared pieces of the target (launcher + sampler) tests."""

from __future__ import annotations

import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from kvprobe.engines.base import MetricMap

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
FAKE_ENGINE = HERE / "fake_engine.py"

# The names as the fixture files expose them, so these tests do not wait for the dialect modules.
VLLM_MAP = MetricMap(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    usage="vllm:kv_cache_usage_perc",
    usage_fallbacks=("vllm:gpu_cache_usage_perc",),
    waiting_capacity=("vllm:num_requests_waiting_by_reason", {"reason": "capacity"}),
    preemptions="vllm:num_preemptions",
)
SGLANG_MAP = MetricMap(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    usage="sglang:token_usage",
    preemptions="sglang:num_retracted_requests",
    used_tokens="sglang:num_used_tokens",
    pool_tokens="sglang:max_total_num_tokens",
)



def fake_argv(*extra: str) -> list[str]:
    return [sys.executable, str(FAKE_ENGINE), "--port", "{port}", *extra]


def gone(pid: int) -> bool:
    """The process no longer runs (a zombie waiting for init to reap it counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(predicate, timeout: float, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return predicate()


class MetricsServer:
    """A real HTTP server whose /metrics answer a test changes while a sampler scrapes it."""

    def __init__(self):
        self.status = 200
        self.body = b""
        self.delay = 0.0
        self.seen_headers: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):  # noqa: N802
                outer.seen_headers.append(dict(self.headers))
                if outer.delay:
                    time.sleep(outer.delay)
                status, body = (outer.status, outer.body) if self.path == "/metrics" else (404, b"")
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def metrics_server():
    server = MetricsServer()
    yield server
    server.close()
