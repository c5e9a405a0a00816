"""The load path against kvprobe's own vLLM emulator (real HTTP, real Locust subprocess)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import group_gone

from kvprobe.analysis.live import with_in_flight
from kvprobe.load.runner import LocustRun, free_port
from kvprobe.procgroup import signal_own_group

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def emulator(tmp_path):
    try:
        import kvprobe.cli.emulate  # noqa: F401
    except ImportError:
        pytest.skip("kvprobe.targets.emulator not available")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvprobe", "emulate", "vllm", "--port", str(port),
                             "--num-gpu-blocks-override", "2000", "--trace", str(tmp_path / "trace.jsonl")],
                            stdout=open(tmp_path / "emulator.log", "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                signal_own_group(proc, signal.SIGKILL)
                pytest.fail("emulator did not become healthy: " + (tmp_path / "emulator.log").read_text()[-2000:])
            time.sleep(0.1)
    yield url
    signal_own_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        signal_own_group(proc, signal.SIGKILL)
        proc.wait(timeout=5)


def test_exact_fixed_length_requests_against_the_emulator(emulator, tmp_path):
    p, o = 50, 12
    run = LocustRun(emulator, model=None, prompt_tokens=p, output_tokens=o, workdir=tmp_path / "locust",
                    time_limit=60)
    with run:
        run.start()
        run.set_users(4)
        run.wait_level(4, timeout=20)
        deadline = time.monotonic() + 20
        while sum(1 for r in run.records("request") if r.status == 200) < 20 and time.monotonic() < deadline:
            time.sleep(0.2)
    assert group_gone(run.pgid)
    done = [r for r in run.records("request") if r.status != "aborted"]
    assert len(done) >= 20
    assert all(r.status == 200 and (r.prompt_tokens, r.completion_tokens) == (p, o) for r in done), done[:3]
    assert all(r.t_send < r.t_first <= r.t_end for r in done)


def first_sends(records, users: int) -> list[float]:
    """When each of a level's `users` users sent its first request (the level's first sends)."""
    sends = sorted(r.t_send for r in records if r.kind == "request" and r.users == users and r.t_send)
    return sends[:users]


def wait_sent(run: LocustRun, n: int, *, since: float, timeout: float) -> None:
    """Until `n` requests sent since `since` are in the records or the processes' in-flight snapshots."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view, _ = with_in_flight(run.records(in_flight=True))
        if len([r for r in view if r.kind == "request" and r.t_send and r.t_send >= since]) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{n} requests not sent within {timeout} s")


JITTER = 2.0  # seconds: the spread a jittered level's first requests are judged against


@pytest.mark.parametrize("jitter", [0.0, JITTER])
def test_start_jitter_spreads_a_levels_first_requests(emulator, tmp_path, jitter):
    """Locust dispatches a step of users at once: without a start jitter their first requests leave
    together (a cohort in phase); with one, each new user waits uniform(0, jitter) s first."""
    run = LocustRun(emulator, model=None, prompt_tokens=50, output_tokens=200, workdir=tmp_path / "locust",
                    time_limit=60, start_jitter=jitter)
    with run:
        run.start()
        asked = time.time()
        run.set_users(8)
        t_level = run.wait_level(8, since=asked, timeout=20)
        deadline = time.monotonic() + 20
        while len(first_sends(run.records("request"), 8)) < 8 and time.monotonic() < deadline:
            time.sleep(0.2)
    sends = first_sends(run.records("request"), 8)
    assert len(sends) == 8, sends
    spread = sends[-1] - sends[0]
    if jitter:  # eight uniform draws over 2 s span ~1.6 s; under 0.6 s by chance about once in 10^3
        assert 0.3 * jitter <= spread and sends[-1] - t_level <= jitter + 1.0, (spread, sends[-1] - t_level)
    else:  # dispatched at once: they leave within a moment of each other
        assert spread < 0.3 * JITTER, spread


@pytest.mark.parametrize("processes", [1, 2])
def test_a_level_may_name_its_own_start_jitter(emulator, tmp_path, processes):
    """A level asked for with start_jitter=0 sends its new users at once although the run's jitter is
    2 s, and the next level, naming none, spreads its new users over the run's jitter again — in one
    Locust process and with a master and two workers (the jitter travels with the level message)."""
    run = LocustRun(emulator, model=None, prompt_tokens=50, output_tokens=1000, workdir=tmp_path / "locust",
                    time_limit=60, start_jitter=JITTER, processes=processes)
    with run:
        run.start()
        run.set_users(8, start_jitter=0.0)
        assert run.level_jitter == 0.0
        t8 = run.wait_level(8, timeout=20)
        # a request's record takes the level in force when its user starts it: on a busy machine a
        # worker's users may not have started theirs when the next level's message arrives
        wait_sent(run, 8, since=t8 - 0.5, timeout=20)
        run.set_users(16)
        assert run.level_jitter == JITTER
        t16 = run.wait_level(16, timeout=20)
        # a request is recorded when it ends, after 1000 decode steps (5 s or more): every first request
        # has, before any user's second one was sent (the new users' first ones leave within JITTER)
        deadline = time.monotonic() + 60
        while len([r for r in run.records("request") if r.t_send]) < 16 and time.monotonic() < deadline:
            time.sleep(0.2)
    records = run.records("request")
    at_once = first_sends(records, 8)
    spread_in = first_sends(records, 16)[:8]
    assert len(at_once) == 8 and len(spread_in) == 8, (at_once, spread_in)
    assert at_once[0] >= t8 - 0.5, (at_once, t8)
    # at once within each Locust process: two workers get the level's message each in its turn, which on a
    # busy machine can be most of a second apart (0.69 s seen), and that is delivery, not jitter
    by_worker: dict[str | None, list[float]] = {}
    for r in records:
        if r.kind == "request" and r.users == 8 and r.t_send and r.t_send <= at_once[-1]:
            by_worker.setdefault(r.worker, []).append(r.t_send)
    assert len(by_worker) == processes, sorted(by_worker, key=str)
    for worker, sends in by_worker.items():
        assert max(sends) - min(sends) < 0.3 * JITTER, (worker, sorted(sends))
    spread = spread_in[-1] - spread_in[0]
    assert 0.3 * JITTER <= spread and spread_in[-1] - t16 <= JITTER + 1.0, (spread, spread_in[-1] - t16)


LOCUST_SHAPE_TICK = 1.0  # seconds: Locust's shape worker calls tick() once a second (runners.py shape_worker)


def test_a_level_asked_for_reaches_locust_within_a_fraction_of_its_tick(emulator, tmp_path):
    """The shape watches its control file through most of each of Locust's one-second ticks, so a
    level asked for (a tick or more after the last, as a probe's levels are) is handed to Locust at
    once, not up to a tick later (half a second per level); and the first, asked for as soon as
    Locust runs, is not kept waiting for the tick after an empty start (a second per probe)."""
    run = LocustRun(emulator, model=None, prompt_tokens=50, output_tokens=4, workdir=tmp_path / "locust",
                    time_limit=60)
    seen = []
    with run:
        run.start()
        # the first at once, then each a tick and more after the last, at another point of Locust's second
        for users, offset in ((2, None), (4, 0.45), (3, 0.8), (5, 0.25), (2, 0.6), (4, 0.95)):
            if offset is not None:
                time.sleep((1 + offset) * LOCUST_SHAPE_TICK)
            asked = time.time()
            run.set_users(users)
            run.wait_level(users, since=asked, timeout=20)
            seen.append(run.level_records()[-1].t_set - asked)
    # without the watch, six waits uniform over the tick all fall under 0.3 of it once in ~1,400 runs
    assert all(0.0 <= s < 0.3 * LOCUST_SHAPE_TICK for s in seen), seen


def _counter(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def test_shared_prompt_prefix_hits_the_emulators_prefix_cache(emulator, tmp_path):
    p, k, o = 64, 40, 4  # 40 shared tokens: 2 full blocks of 16 are hashed and shared
    run = LocustRun(emulator, model=None, prompt_tokens=p, output_tokens=o, workdir=tmp_path / "locust",
                    time_limit=60, shared_prefix_tokens=k)
    with run:
        run.start()
        run.set_users(3)
        run.wait_level(3, timeout=20)
        deadline = time.monotonic() + 20
        while sum(1 for r in run.records("request") if r.status == 200) < 12 and time.monotonic() < deadline:
            time.sleep(0.2)
    assert group_gone(run.pgid)
    done = [r for r in run.records("request") if r.status == 200]
    assert len(done) >= 12 and all((r.prompt_tokens, r.completion_tokens) == (p, o) for r in done)
    queries = _counter(emulator, "vllm:prefix_cache_queries_total")
    hits = _counter(emulator, "vllm:prefix_cache_hits_total")
    admitted = queries // p
    assert admitted >= 12
    assert hits == 32 * (admitted - 1)  # everyone but the first finds the two full blocks, never more
