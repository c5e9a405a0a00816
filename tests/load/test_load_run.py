"""Real Locust subprocesses against the real SSE test server (tests/load/sse_server.py)."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
from conftest import group_gone

from kvprobe.analysis.live import with_in_flight
from kvprobe.errors import ProbeError
from kvprobe.load.records import IN_FLIGHT, level_windows
from kvprobe.load.runner import LocustRun

pytestmark = pytest.mark.slow

PROMPT, OUT = 37, 9


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def n_requests(run: LocustRun, users: int | None = None) -> int:
    return sum(1 for r in run.records("request") if r.t_end and (users is None or r.users == users))


def test_ramp_exact_usage_levels_and_records(sse_server, tmp_path):
    run = LocustRun(sse_server.url, model="m", prompt_tokens=PROMPT, output_tokens=OUT, workdir=tmp_path, time_limit=60)
    with run:
        run.start()
        for users in (3, 5):
            asked = time.time()
            run.set_users(users)
            t_level = run.wait_level(users, since=asked, timeout=15)
            assert t_level >= asked
            wait_for(lambda u=users: n_requests(run, u) >= 4 * u, 20, f"requests at {users} users")
        rc = run.stop()
    assert rc == 0
    assert group_gone(run.pgid)
    recs = run.records()
    levels = [r for r in recs if r.kind == "level"]
    assert [lv.users for lv in levels] == [0, 3, 5]
    assert all(lv.t_set is not None and lv.t_set <= lv.t for lv in levels)
    done = [r for r in recs if r.kind == "request" and r.status != "aborted"]
    assert done and all(r.status == 200 for r in done)
    assert all((r.prompt_tokens, r.completion_tokens) == (PROMPT, OUT) for r in done)
    assert all(r.t_send < r.t_first <= r.t_end for r in done)
    # users at send matches the level window the request was sent in
    windows = level_windows(recs)
    for r in done:
        (users,) = [u for u, t0, t1 in windows if t0 <= r.t_send < t1] or [r.users]
        assert r.users in (users, windows[[w[0] for w in windows].index(users) - 1][0])
    assert {r.users for r in done} == {3, 5}
    assert any(r.kind == "lag" and r.worker == "w0" for r in recs)
    # every prompt the server saw was PROMPT ids long and unique from its first token
    trace = sse_server.trace_rows()
    mine = [t for t in trace if t["request_id"].startswith(run.run_id)]
    assert len(mine) >= len(done)
    assert all(t["prompt_len"] == PROMPT for t in mine)
    firsts = [t["first_id"] for t in mine]
    assert len(set(firsts)) == len(firsts)


def test_usage_mismatch_is_an_error_record_with_both_counts(sse_server, tmp_path):
    run = LocustRun(sse_server.url, model="wrong-usage", prompt_tokens=PROMPT, output_tokens=OUT, workdir=tmp_path,
                    time_limit=60)
    with run:
        run.start(users=2)
        wait_for(lambda: n_requests(run) >= 4, 20, "requests")
    done = [r for r in run.records("request") if r.status != "aborted"]
    assert done and all(r.status == "usage_mismatch" for r in done)
    assert all(r.completion_tokens == OUT + 1 and r.prompt_tokens == PROMPT for r in done)
    assert f"completion_tokens={OUT + 1}" in done[0].error


def test_http_errors_are_recorded_and_backed_off(sse_server, tmp_path):
    run = LocustRun(sse_server.url, model="http-400", prompt_tokens=PROMPT, output_tokens=OUT, workdir=tmp_path,
                    time_limit=60)
    with run:
        run.start(users=2)
        t0 = time.time()
        wait_for(lambda: n_requests(run) >= 6, 20, "error records")
        time.sleep(1.0)
        t1 = time.time()
    recs = [r for r in run.records("request") if r.status != "aborted"]
    assert recs and all(r.status == 400 and "bad request for testing" in r.error for r in recs)
    # without back-off 2 users against an instant 400 send hundreds a second
    rate = sum(1 for r in recs if t0 <= r.t_send <= t1) / (t1 - t0)
    assert rate < 2 * 25


def test_dead_server_gives_connection_records_not_a_flood(tmp_path):
    from kvprobe.load.runner import free_port

    run = LocustRun(f"http://127.0.0.1:{free_port()}", model="m", prompt_tokens=PROMPT, output_tokens=OUT,
                    workdir=tmp_path, time_limit=60)
    with run:
        run.start(users=3)
        wait_for(lambda: n_requests(run) >= 9, 20, "connection records")
        time.sleep(1.0)
    recs = [r for r in run.records("request") if r.status != "aborted"]
    assert recs and all(r.status == "connection" for r in recs)
    span = max(r.t_send for r in recs) - min(r.t_send for r in recs)
    assert len(recs) / max(span, 0.5) < 3 * 25
    assert "Traceback" not in run.log_tail(400)


def test_non_streaming_mode(sse_server, tmp_path):
    run = LocustRun(sse_server.url, model="m", prompt_tokens=PROMPT, output_tokens=OUT, workdir=tmp_path,
                    stream=False, time_limit=60)
    with run:
        run.start(users=2)
        wait_for(lambda: n_requests(run) >= 4, 20, "requests")
    done = [r for r in run.records("request") if r.status != "aborted"]
    assert done and all(r.status == 200 and r.t_first is None for r in done)
    assert all((r.prompt_tokens, r.completion_tokens) == (PROMPT, OUT) for r in done)


def test_sigterm_during_shape_flushes_records(sse_server, tmp_path):
    run = LocustRun(sse_server.url, model="m", prompt_tokens=PROMPT, output_tokens=OUT, workdir=tmp_path, time_limit=60)
    try:
        run.start(users=3)
        wait_for(lambda: n_requests(run) >= 3, 20, "first records")
        run.terminate()  # SIGTERM while the shape runs: Locust's own handler is not installed yet
        wait_for(lambda: not run.group_alive(), 10, "Locust to exit on SIGTERM")
        # the group can look gone (its leader a zombie) a moment before poll() reaps the leader's status
        wait_for(lambda: run.returncode is not None, 10, "Locust's exit status")
        assert run.returncode == 143
    finally:
        run.stop(timeout=5)
    recs = run.records("request")
    assert all(r.status in (200, "aborted") for r in recs)
    # Every request the server saw is in the records — finished, or aborted by the shutdown —
    # including the ones in flight when the signal came (nothing was lost in a buffer).
    seen = {t["request_id"] for t in sse_server.trace_rows() if t["request_id"].startswith(run.run_id)}
    recorded = {r.request_id for r in recs}
    assert len(seen) >= 6 and seen <= recorded
    assert len(recorded) == len(recs)


def test_time_limit_stops_locust_by_itself(sse_server, tmp_path):
    run = LocustRun(sse_server.url, model="m", prompt_tokens=PROMPT, output_tokens=OUT, workdir=tmp_path, time_limit=2)
    try:
        run.start(users=1)
        wait_for(lambda: not run.alive(), 15, "Locust to stop at its time limit")
        assert run.returncode == 0
        assert group_gone(run.pgid)
    finally:
        run.stop(timeout=5)
    assert n_requests(run) >= 1


def test_two_processes_both_record_their_requests_and_those_in_flight_and_leave_nothing(sse_server, tmp_path):
    run = LocustRun(sse_server.url, model="m", prompt_tokens=PROMPT, output_tokens=OUT, workdir=tmp_path,
                    processes=2, time_limit=60, seed=3)
    with run:
        run.start()
        run.set_users(6)
        run.wait_level(6, timeout=20)
        wait_for(lambda: n_requests(run, 6) >= 24, 30, "requests from both workers")
        view, whole = with_in_flight(run.records(in_flight=True))
        read_at = time.time()
        rc = run.stop()
    assert rc == 0
    assert group_gone(run.pgid)
    # live, the streams are whole up to the processes' latest snapshots (every half second), not a latency ago
    assert whole is not None and read_at - 5.0 < whole <= read_at
    assert {snap.worker for snap in run.records(IN_FLIGHT)} == {"w0", "w1"}
    in_flight = [r for r in view if r.t_end is None]
    assert 1 <= len(in_flight) <= 6 and all(r.t_send <= read_at for r in in_flight)
    assert not {r.request_id for r in in_flight} & {r.request_id for r in view if r.t_end is not None}
    recs = run.records()
    assert all(r.kind != IN_FLIGHT for r in recs)
    # each request the snapshots held in flight ended with a record of its own
    assert {r.request_id for r in in_flight} <= {r.request_id for r in recs if r.kind == "request"}
    done = [r for r in recs if r.kind == "request" and r.status == 200]
    per_worker = Counter(r.worker for r in done)
    assert set(per_worker) == {"w0", "w1"} and min(per_worker.values()) >= 5
    assert {r.users for r in done} == {6}  # the global count, not the worker's share
    assert [r.users for r in recs if r.kind == "level"] == [0, 6]
    assert all(r.worker == "master" for r in recs if r.kind == "level")
    firsts = [t["first_id"] for t in sse_server.trace_rows() if t["request_id"].startswith(run.run_id)]
    assert len(firsts) >= len(done) and len(set(firsts)) == len(firsts)


def test_api_key_is_sent_but_never_written(sse_server, tmp_path, monkeypatch):
    secret = "kvp-test-secret-4711"
    monkeypatch.setenv("KVPROBE_TEST_KEY", secret)
    run = LocustRun(sse_server.url, model="m", prompt_tokens=PROMPT, output_tokens=OUT, workdir=tmp_path,
                    api_key_env="KVPROBE_TEST_KEY", time_limit=60)
    with run:
        run.start(users=1)
        wait_for(lambda: n_requests(run) >= 2, 20, "requests")
    assert secret not in " ".join(run.command())
    seen = {t["auth"] for t in sse_server.trace_rows() if t["request_id"].startswith(run.run_id)}
    assert seen == {f"Bearer {secret}"}
    for dirpath, _dirs, files in os.walk(tmp_path):
        for f in files:
            assert secret not in open(os.path.join(dirpath, f), errors="replace").read(), f


def test_start_fails_fast_with_log_tail_when_locust_cannot_run(tmp_path):
    run = LocustRun("http://127.0.0.1:9", model="m", prompt_tokens=PROMPT, output_tokens=OUT, workdir=tmp_path,
                    engine="no-such-engine", path="relative-path-is-fine", time_limit=60, startup_timeout=20)
    run.command = lambda: [*LocustRun.command(run), "--no-such-option"]
    with pytest.raises(ProbeError, match="Locust exited"):
        run.start()
    assert group_gone(run.pgid)
