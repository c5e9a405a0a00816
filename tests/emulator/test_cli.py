"""`python -m kvprobe emulate ...` as a real subprocess in its own process group: startup lines,
health, refusal to start, clean shutdown on SIGTERM / SIGINT."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvprobe.engines import get_dialect

REPO = Path(__file__).parents[2]


class Proc:
    def __init__(self, argv: list[str], log: Path):
        self.log = log
        self.fh = open(log, "wb")  # noqa: SIM115
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.p = subprocess.Popen([sys.executable, "-m", "kvprobe", "emulate", *argv], stdout=self.fh,
                                  stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text()

    def wait_port(self, pattern: str, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if m := re.search(pattern, self.text()):
                return int(m.group(1))
            if self.p.poll() is not None:
                raise AssertionError(f"emulator exited {self.p.returncode}:\n{self.text()}")
            time.sleep(0.05)
        raise AssertionError(f"no serving line within {timeout}s:\n{self.text()}")

    def kill(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(5)
        self.fh.close()


@pytest.fixture
def proc(tmp_path):
    started: list[Proc] = []

    def make(argv):
        started.append(Proc(argv, tmp_path / f"emu{len(started)}.log"))
        return started[-1]

    yield make
    for p in started:
        p.kill()


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_vllm_process_startup_lines_and_shutdown(proc, sig):
    p = proc(["vllm", "--port", "0", "--num-gpu-blocks-override", "2048", "--max-model-len", "8192"])
    port = p.wait_port(r"Starting vLLM API server 0 on http://127\.0\.0\.1:(\d+)")
    assert _get(f"http://127.0.0.1:{port}/health") == (200, b"")
    rep = get_dialect("vllm").parse_startup_log(p.text())
    assert (rep.kv_tokens, rep.max_model_len, rep.max_concurrency) == (32768, 8192, 4.0)
    t0 = time.monotonic()
    os.killpg(p.p.pid, sig)
    assert p.p.wait(5) == 0
    assert time.monotonic() - t0 < 1.5, "shutdown took longer than a second (plus process exit)"


def test_vllm_011_two_line_capacity_log(proc):
    p = proc(["vllm", "--port", "0", "--num-gpu-blocks-override", "2048", "--engine-version", "0.11.0"])
    p.wait_port(r"on http://127\.0\.0\.1:(\d+)")
    assert "GPU KV cache size: 32,768 tokens\n" in p.text()
    assert get_dialect("vllm").parse_startup_log(p.text()).max_concurrency == 4.0


def test_vllm_refuses_pool_too_small_for_max_model_len(proc):
    p = proc(["vllm", "--port", "0", "--num-gpu-blocks-override", "256", "--max-model-len", "4096"])
    assert p.p.wait(20) != 0
    assert "the estimated maximum model length is 4080" in p.text()


def test_sglang_process_startup_line(proc):
    p = proc(["sglang", "--port", "0", "--max-total-tokens", "46611", "--context-length", "131072",
              "--chunked-prefill-size", "2048", "--enable-metrics"])
    port = p.wait_port(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
    rep = get_dialect("sglang").parse_startup_log(p.text())
    assert (rep.kv_tokens, rep.max_model_len, rep.token_budget, rep.max_running) == (46611, 131072, 2048, 2048)
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] max_total_num_tokens=46611, ", p.text(), re.M)
    status, body = _get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200 and b"sglang:max_total_num_tokens" in body
    os.killpg(p.p.pid, signal.SIGTERM)
    assert p.p.wait(5) == 0


@pytest.mark.parametrize(("flag", "value", "version", "says"), [
    ("--watermark", "0.1", "0.23.0", "unrecognized arguments: --watermark 0.1"),
    ("--max-num-active-seqs", "4", "0.30.0", "has no --max-num-active-seqs"),
])
def test_vllm_refuses_a_flag_its_release_does_not_have(proc, flag, value, version, says):
    # the engine's own argument parser stops it before any start-up line (exit 2, as argparse exits)
    p = proc(["vllm", "--port", "0", "--num-gpu-blocks-override", "2048", "--engine-version", version, flag, value])
    assert p.p.wait(20) == 2
    assert says in p.text() and "GPU KV cache size" not in p.text()
