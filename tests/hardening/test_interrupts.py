"""SIGINT and SIGTERM in the middle of a ramp — to the console probe, and Ctrl-C to `pytest --kvprobe`:
the engine's and Locust's process groups are stopped (checked by group id) and the partial artifacts
(result.json, requests.jsonl, engine.log) are written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.probe.conftest import TINY

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def project(root: Path, name: str = "interrupted") -> Path:
    """loadprofiles/tiny.yaml + expectations/NAME.yaml (the shipped vLLM one on the tiny profile)."""
    (root / "loadprofiles").mkdir(parents=True, exist_ok=True)
    (root / "loadprofiles" / "tiny.yaml").write_text(TINY)
    (root / "expectations").mkdir(exist_ok=True)
    doc = yaml.safe_load((REPO / "expectations" / "emulated-vllm.yaml").read_text())
    doc.update(name=name, profile="tiny")
    path = root / "expectations" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def ramp_running(art: Path) -> bool:
    """Requests have completed under load: Locust and the engine are both up and busy."""
    for f in (art / "locust" / "records").glob("*.jsonl"):
        if '"status":200' in f.read_text(errors="replace"):
            return True
    return False


def child_groups(pid: int) -> set[int]:
    """Process groups of the descendants of `pid` other than its own (the engine's, Locust's)."""
    own = os.getpgid(pid)
    out = set()
    for child in psutil.Process(pid).children(recursive=True):
        try:
            pgid = os.getpgid(child.pid)
        except ProcessLookupError:
            continue
        if pgid != own:
            out.add(pgid)
    return out


def interrupt_mid_ramp(proc: subprocess.Popen, art: Path, sig: int) -> set[int]:
    """Wait (bounded) for the ramp, note the child groups, send `sig`; returns the groups seen."""
    deadline = time.monotonic() + 60
    groups: set[int] = set()
    while time.monotonic() < deadline and proc.poll() is None:
        groups |= child_groups(proc.pid)
        if len(groups) >= 2 and ramp_running(art):
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the probe ended before it could be interrupted"
    assert len(groups) >= 2, groups  # the engine's group and Locust's
    proc.send_signal(sig)
    return groups


def assert_groups_gone(groups: set[int]) -> None:
    for pgid in groups:
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)


def assert_partial_artifacts(art: Path) -> None:
    doc = json.loads((art / "result.json").read_text())
    assert doc["verdict"]["passed"] is False
    records = (art / "requests.jsonl").read_text().splitlines()
    assert any(json.loads(r)["status"] == 200 for r in records)
    assert (art / "engine.log").stat().st_size > 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_console_probe_interrupted_mid_ramp(tmp_path, sig):
    exp_path = project(tmp_path)
    art = tmp_path / "art"
    proc = subprocess.Popen([sys.executable, "-m", "kvprobe", "probe", str(exp_path), "--artifacts", str(art)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        groups = interrupt_mid_ramp(proc, art, sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["kvprobe probe: interrupted"], err
    assert_groups_gone(groups | {proc.pid})
    assert_partial_artifacts(art)


def test_pytest_ctrl_c_during_a_probe(pytester):
    project(pytester.path, "ctrlc")
    pytester.makeini("[pytest]\naddopts = -p no:cacheprovider\n")
    art = pytester.path / "art"
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "--kvprobe", "--kvprobe-artifacts", str(art),
                             "expectations"], cwd=pytester.path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        groups = interrupt_mid_ramp(proc, art / "ctrlc", signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "KeyboardInterrupt" in out
    assert_groups_gone(groups | {proc.pid})
    assert_partial_artifacts(art / "ctrlc")
