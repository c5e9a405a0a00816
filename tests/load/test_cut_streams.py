"""A stream cut by a ramp-down or by the end of the load keeps its first-token time:
real Locust against the real SSE test server, streams slow enough to be cut."""

from __future__ import annotations

import time

import pytest
from conftest import start_server, stop_server

from kvprobe.load.records import ABORTED
from kvprobe.load.runner import LocustRun

pytestmark = pytest.mark.slow

PROMPT, OUT, ITL = 16, 40, 0.1  # a stream lasts about 4 s


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def slow_server(tmp_path):
    srv = start_server(tmp_path, ttft=0.05, itl=ITL)
    yield srv
    stop_server(srv.proc)


def test_streams_cut_by_a_ramp_down_and_by_the_stop_keep_their_first_token(slow_server, tmp_path):
    run = LocustRun(slow_server.url, model="m", prompt_tokens=PROMPT, output_tokens=OUT, workdir=tmp_path,
                    time_limit=60)
    with run:
        run.start(users=3)
        # three streams under way: the server has sent each its first token (its trace says so)
        wait_for(lambda: len([t for t in slow_server.trace_rows() if t["request_id"].startswith(run.run_id)]) >= 3,
                 20, "three first tokens")
        run.set_users(1)  # ramp-down: two streams are cut mid-way
        run.wait_level(1, timeout=15)
        t_stop = time.time()
        run.stop()  # the end of the load cuts the last one
    firsts = {t["request_id"]: t["t_first"] for t in slow_server.trace_rows()}
    cut = [r for r in run.records("request") if r.status == ABORTED]
    assert len(cut) >= 3, [(r.status, r.t_first) for r in run.records("request")]
    for r in cut:
        if r.request_id in firsts:  # the server sent a first token before the cut
            assert r.t_first is not None, r
            assert abs(r.t_first - firsts[r.request_id]) < 0.5  # the client saw it when it came
            assert r.t_first < r.t_end
    started = [r for r in cut if r.request_id in firsts]
    assert len(started) >= 3 and any(r.t_end >= t_stop for r in started)
