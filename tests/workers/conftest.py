"""`kvprobe worker` processes on 127.0.0.1, each in its own process group, stopped by group id."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvprobe.procgroup import signal_own_group

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Worker:
    proc: subprocess.Popen
    cwd: Path
    log: Path

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        signal_own_group(self.proc, sig)

    def wait_exit(self, seconds: float) -> int | None:
        try:
            return self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return None


def group_gone(pgid: int, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def start_workers(tmp_path):
    """`start_workers(n, port)` → n `kvprobe worker --master 127.0.0.1:port`, each with its own empty
    working folder (nothing is shared with the master); every group is killed by id afterwards."""
    started: list[Worker] = []

    def start(n: int, port: int) -> list[Worker]:
        out = []
        for _ in range(n):
            k = len(started)
            cwd = tmp_path / f"worker{k}"
            cwd.mkdir()
            log = tmp_path / f"worker{k}.log"
            cmd = [sys.executable, "-m", "kvprobe", "worker", "--master", f"127.0.0.1:{port}"]
            proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=open(log, "wb"),  # noqa: SIM115
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONPATH": str(REPO)})
            w = Worker(proc, cwd, log)
            started.append(w)
            out.append(w)
        return out

    yield start
    for w in started:
        w.kill()
        w.wait_exit(5)
        w.proc.stdout and w.proc.stdout.close()
    for w in started:
        assert group_gone(w.pgid), f"worker group {w.pgid} left behind"
