"""Fixtures for the load tests: a real vLLM-shaped SSE server (tests/load/sse_server.py) on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvprobe.procgroup import signal_own_group

SERVER = Path(__file__).with_name("sse_server.py")


@dataclass
class SseServer:
    url: str
    trace: Path
    proc: subprocess.Popen

    def trace_rows(self) -> list[dict]:
        # the server flushes its trace every 0.5 s: poll (bounded) until it stops growing
        rows: list[dict] = []
        deadline = time.monotonic() + 3.0
        last = -1
        while time.monotonic() < deadline:
            text = self.trace.read_text() if self.trace.exists() else ""
            rows = [json.loads(x) for x in text.splitlines() if x.strip()]
            if len(rows) == last:
                break
            last = len(rows)
            time.sleep(0.6)
        return rows


def start_server(tmp: Path, *, ttft: float = 0.01, itl: float = 0.01, timeout: float = 15.0) -> SseServer:
    trace = tmp / "server-trace.jsonl"
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port", "0", "--ttft", str(ttft), "--itl", str(itl),
                             "--trace", str(trace)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("PORT ") or proc.poll() is not None:
            break
    if not line.startswith("PORT "):
        stop_server(proc)
        raise RuntimeError(f"SSE test server did not start: {line!r}")
    return SseServer(f"http://127.0.0.1:{int(line.split()[1])}", trace, proc)


def stop_server(proc: subprocess.Popen) -> None:
    signal_own_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        signal_own_group(proc, signal.SIGKILL)
        proc.wait(timeout=5)


@pytest.fixture(scope="session")
def sse_server(tmp_path_factory) -> SseServer:
    srv = start_server(tmp_path_factory.mktemp("sse"))
    yield srv
    stop_server(srv.proc)


def group_gone(pgid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False
