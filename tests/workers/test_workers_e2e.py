"""Load from many hosts, on one: real `kvprobe worker` processes (own process groups) against a
real Locust master, the emulator and the SSE test server over 127.0.0.1. No folder is shared: each
worker runs in an empty folder of its own, and its records reach the master over Locust's messaging."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from kvprobe.errors import ProbeError
from kvprobe.load.runner import LocustRun
from kvprobe.procgroup import free_port
from kvprobe.spec.profile import load_profile
from tests.load.conftest import start_server, stop_server
from tests.workers.conftest import group_gone

pytestmark = pytest.mark.slow

# Around the emulated vLLM pool's limit of ~20 (expectations/emulated-vllm.yaml); short levels:
# this test is about where the records come from, not about the plateau's precision.
PROFILE = """
name: workers
request: {{prompt_tokens: 128, output_tokens: 32, stream: true}}
ramp: {{strategy: explicit, levels: [12, 24, 30]}}
hold: {{seconds: 2.5, warmup: 0.3}}
budget_seconds: 60
drain_seconds: 4
workers: {{expect: 2, bind: "127.0.0.1:{port}", wait_seconds: 30}}
"""


def test_a_probe_with_two_workers_gets_every_record_and_health_per_worker(tmp_path, start_workers):
    """Three workers start for a profile that expects two: the third is sent home, saying why."""
    from kvprobe.probe.run import ProbeOptions, run_probe
    from kvprobe.spec.expectation import load_expectations

    port = free_port()
    path = tmp_path / "workers.yaml"
    path.write_text(PROFILE.format(port=port))
    trace = tmp_path / "engine-trace.jsonl"
    exp = load_expectations(Path(__file__).resolve().parents[2] / "expectations" / "emulated-vllm.yaml")[0]
    exp = replace(exp, profile=load_profile(path), checks=("exactness", "rejection_point"),
                  target=replace(exp.target, emulator={"seed": 0, "args": ["--trace", str(trace)]}))
    workers = start_workers(3, port)
    lines: list[str] = []
    result = run_probe(exp, ProbeOptions(artifacts_dir=tmp_path / "art", log=lines.append))
    assert result.error is None, (result.error, result.log_tail)
    assert f"kvprobe worker --master 127.0.0.1:{port}" in "\n".join(lines)
    assert result.check("exactness").passed
    assert [lv.users for lv in result.levels] == [12, 24, 30]
    recs = [json.loads(x) for x in Path(result.artifacts["requests"]).read_text().splitlines()]
    per_worker = Counter(r["worker"] for r in recs if r["kind"] == "request")
    assert set(per_worker) == {"w0", "w1"} and min(per_worker.values()) >= 20, per_worker
    # The engine's own trace: every request it saw is a record at the master (none lost on the way),
    # and every request the client says completed, the engine served.
    seen = {json.loads(x)["id"] for x in trace.read_text().splitlines() if x.strip()} - {None}  # None: calibration
    ids = {r["request_id"] for r in recs if r["kind"] == "request"}
    done = {r["request_id"] for r in recs if r["kind"] == "request" and r["status"] == 200}
    assert seen and seen <= ids and done <= seen, (len(seen - ids), len(done - seen))
    events = Counter((r["worker"], r["status"]) for r in recs if r["kind"] == "worker")
    assert events == {("w0", "connected"): 1, ("w1", "connected"): 1, ("w0", "final"): 1, ("w1", "final"): 1,
                      ("w2", "refused"): 1}
    # one host, one clock: the skew measured over the link is the link's latency, far under 0.25 s
    assert all(abs(r["clock_offset"]) < 0.25 for r in recs if r["kind"] == "worker" and r["status"] == "final")
    # client health per worker, in the result and its JSON
    assert [w.worker for w in result.client.workers] == ["w0", "w1"]
    assert all(w.seconds >= 5 and w.host for w in result.client.workers)
    doc = json.loads(Path(result.artifacts["result"]).read_text())
    assert [w["worker"] for w in doc["client"]["workers"]] == ["w0", "w1"]
    assert "load processes" in Path(result.artifacts["report"]).read_text()
    for w in workers:  # the workers end with the probe, and wrote nothing where they ran
        assert w.wait_exit(15) == 0, w.log.read_text()[-2000:]
        assert list(w.cwd.iterdir()) == []
    refused = [w for w in workers if "already has the 2 worker(s) its profile expects" in w.log.read_text()]
    assert len(refused) == 1


@pytest.fixture
def sse(tmp_path):
    srv = start_server(tmp_path, ttft=0.02, itl=0.05)
    yield srv
    stop_server(srv.proc)


def _run(url, tmp_path, port, *, wait=30.0):
    return LocustRun(url, model="m", prompt_tokens=16, output_tokens=20, workdir=tmp_path / "locust", time_limit=60,
                     expect_workers=2, bind_port=port, workers_wait=wait)


def test_a_missing_worker_times_out_naming_the_count_and_the_command(sse, tmp_path, start_workers):
    port = free_port()
    (worker,) = start_workers(1, port)
    run = _run(sse.url, tmp_path, port, wait=4.0)
    t0 = time.monotonic()
    with pytest.raises(ProbeError) as err:
        run.start()
    took = time.monotonic() - t0
    msg = str(err.value)
    assert "1 of 2 Locust workers connected within 4 s" in msg and "connected: w0 on " in msg
    assert f"kvprobe worker --master 127.0.0.1:{port}" in msg
    assert 4.0 <= took < 20.0, took
    assert group_gone(run.pgid)
    assert worker.wait_exit(15) is not None  # told to quit by the master as it stopped


def test_a_probe_whose_worker_dies_ends_in_error_naming_it(tmp_path, start_workers, monkeypatch):
    import threading

    from kvprobe.probe.run import ProbeOptions, run_probe
    from kvprobe.spec.expectation import load_expectations

    port = free_port()
    path = tmp_path / "workers.yaml"
    path.write_text(PROFILE.format(port=port).replace("[12, 24, 30]", "[12, 16, 20, 24, 28, 30]"))
    exp = load_expectations(Path(__file__).resolve().parents[2] / "expectations" / "emulated-vllm.yaml")[0]
    exp = replace(exp, profile=load_profile(path), checks=("exactness",))
    victim, survivor = start_workers(2, port)
    runs: list[LocustRun] = []
    killed: list[float] = []
    start = LocustRun.start
    monkeypatch.setattr(LocustRun, "start", lambda self, **kw: (runs.append(self), start(self, **kw))[1])

    def kill_during_the_ramp():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (runs and len(runs[0].level_records()) >= 2):
            time.sleep(0.1)  # the ramp's first level is reached
        victim.kill()  # SIGKILL: no goodbye, only missing heartbeats
        killed.append(time.monotonic())

    killer = threading.Thread(target=kill_during_the_ramp, daemon=True)
    killer.start()
    t0 = time.monotonic()
    result = run_probe(exp, ProbeOptions(artifacts_dir=tmp_path / "art"))
    killer.join(5)
    assert killed and time.monotonic() - killed[0] < 20  # found out by the heartbeat, not by a deadline
    assert result.status == "error"
    assert "1 of 2 Locust workers stopped during the load (worker w" in result.error, result.error
    assert "no heartbeat" in result.error
    assert len(result.levels) < 6 and time.monotonic() - t0 < 60
    assert "Locust workers stopped" in Path(result.artifacts["report"]).read_text()
    assert group_gone(runs[0].pgid)
    assert survivor.wait_exit(15) == 0
