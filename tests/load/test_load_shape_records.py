"""Control-file shape logic and the record files, pure (no Locust in this process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvprobe.load.records import IN_FLIGHT, Record, RecordWriter, level_windows, read_records
from kvprobe.load.runner import client_health
from kvprobe.load.shape import ShapeControl, write_control


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_shape_follows_the_control_file(tmp_path):
    ctl = tmp_path / "control.json"
    clock = Clock()
    shape = ShapeControl(ctl, time_limit=60, clock=clock)
    assert shape.tick() == (0, 1.0)  # no file yet: hold zero users
    write_control(ctl, users=7, spawn_rate=3)
    assert shape.tick() == (7, 3.0)
    write_control(ctl, users=12)
    assert shape.tick() == (12, 12.0)  # default rate: the whole level in one tick
    assert shape.tick() == (12, 12.0)
    write_control(ctl, stop=True)
    assert shape.tick() is None and shape.stopped_reason == "control"
    write_control(ctl, users=3)
    assert shape.tick() is None  # a stopped shape stays stopped


def test_the_time_limit_counts_from_the_start_or_from_the_first_level_after_an_idle_wait(tmp_path):
    ctl = tmp_path / "control.json"
    clock = Clock()
    plain = ShapeControl(ctl, time_limit=60, clock=clock)
    idle = ShapeControl(ctl, time_limit=60, idle_limit=300, clock=clock)
    clock.t += 200  # waiting at zero users (a probe waiting for its load turn)
    assert plain.tick() is None and plain.stopped_reason == "time_limit"
    assert idle.tick() == (0, 1.0)
    write_control(ctl, users=5)
    assert idle.tick() == (5, 5.0)
    clock.t += 59
    assert idle.tick() == (5, 5.0)  # the load's 60 s count from its first level, not the idle start
    clock.t += 1
    assert idle.tick() is None and idle.stopped_reason == "time_limit"
    never = ShapeControl(tmp_path / "none.json", time_limit=60, idle_limit=300, clock=clock)
    clock.t += 299
    assert never.tick() == (0, 1.0)
    clock.t += 1
    assert never.tick() is None and never.stopped_reason == "idle_limit"  # a parent gone before its load


def test_a_level_may_name_its_start_jitter(tmp_path):
    """The level's own jitter when the control file names one, else None (the run's applies)."""
    ctl = tmp_path / "control.json"
    shape = ShapeControl(ctl, time_limit=60, clock=Clock())
    write_control(ctl, users=7, spawn_rate=7, start_jitter=0.0)
    assert shape.tick() == (7, 7.0) and shape.start_jitter == 0.0
    write_control(ctl, users=9, spawn_rate=2, start_jitter=1.5)
    assert shape.tick() == (9, 2.0) and shape.start_jitter == 1.5
    write_control(ctl, users=12)
    assert shape.tick() == (12, 12.0) and shape.start_jitter is None
    write_control(ctl, users=13, start_jitter=-1)  # not a spread: the run's applies
    assert shape.tick() == (13, 13.0) and shape.start_jitter is None


def test_the_runner_writes_a_levels_start_jitter(tmp_path):
    from kvprobe.errors import ConfigError
    from kvprobe.load.runner import LocustRun

    run = LocustRun("http://127.0.0.1:9", model=None, prompt_tokens=8, output_tokens=8, workdir=tmp_path,
                    start_jitter=2.0)
    assert run.level_jitter == 2.0
    run.set_users(5, start_jitter=0.0)
    assert json.loads(run.control_path.read_text())["start_jitter"] == 0.0 and run.level_jitter == 0.0
    run.set_users(8)  # the run's jitter, named: the process may have started with another
    assert json.loads(run.control_path.read_text())["start_jitter"] == 2.0 and run.level_jitter == 2.0
    run.start_jitter = 1.25  # a probe sets it once its request is timed, its client already started
    run.set_users(10)
    assert json.loads(run.control_path.read_text())["start_jitter"] == 1.25 and run.level_jitter == 1.25
    with pytest.raises(ConfigError, match="start jitter must be >= 0 seconds, got -0.5"):
        run.set_users(9, start_jitter=-0.5)


def test_shape_time_limit_ends_the_test(tmp_path):
    clock = Clock()
    shape = ShapeControl(tmp_path / "c.json", time_limit=5, clock=clock)
    write_control(tmp_path / "c.json", users=2)
    assert shape.tick() == (2, 2.0)
    clock.t += 5.0
    assert shape.tick() is None and shape.stopped_reason == "time_limit"


def test_shape_keeps_last_good_value_on_bad_content(tmp_path):
    ctl = tmp_path / "c.json"
    shape = ShapeControl(ctl, time_limit=60, clock=Clock())
    write_control(ctl, users=4)
    assert shape.tick() == (4, 4.0)
    ctl.write_text("{not json")
    assert shape.tick() == (4, 4.0)
    write_control(ctl, users=-1)
    assert shape.tick() == (4, 4.0)
    assert shape.bad_reads == 2


def test_write_control_is_atomic_and_leaves_no_temp_files(tmp_path):
    ctl = tmp_path / "c.json"
    for n in range(50):
        write_control(ctl, users=n)
        assert json.loads(ctl.read_text()) == {"users": n}
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]


def test_records_round_trip_and_torn_line(tmp_path):
    w = RecordWriter(tmp_path / "local-1.jsonl")
    reqs = [Record(t_send=10.0 + i, t_first=10.1 + i, t_end=11.0 + i, status=200, prompt_tokens=5,
                   completion_tokens=3, users=2, worker="w0", request_id=f"r{i}") for i in range(3)]
    for r in reqs:
        w.write(r)
    w.write(Record(kind="level", t=9.5, users=2, t_set=9.0, worker="w0"))
    w.write(Record(kind="lag", t=10.5, lag_ms=1.5, cpu=0.2, worker="w0"))
    w.close()
    with open(tmp_path / "worker-2.jsonl", "w") as fh:  # a second process, killed mid-line
        fh.write(Record(t_send=9.8, status="usage_mismatch", worker="w1").to_json() + "\n{\"t_send\": 12")
    recs = read_records(tmp_path)
    assert [r.kind for r in recs] == ["level", "request", "request", "lag", "request", "request"]
    assert recs[2] == reqs[0] and recs[2].ok and abs(recs[2].ttft - 0.1) < 1e-9
    assert recs[1].status == "usage_mismatch" and not recs[1].ok
    assert len(read_records(tmp_path, kind="request")) == 4
    assert read_records(tmp_path / "missing") == []


def test_of_the_snapshots_in_flight_only_each_files_latest_whole_one_is_read_and_only_when_asked(tmp_path):
    def snap(t: float, worker: str) -> Record:
        return Record(kind=IN_FLIGHT, t=t, worker=worker, ids=[f"{worker}-{t}"], sends=[t - 0.3], firsts=[None])

    w = RecordWriter(tmp_path / "local-1.jsonl")
    for t in (1.0, 1.5, 2.0):
        w.write(Record(t_send=t - 0.9, t_first=t - 0.8, t_end=t - 0.1, status=200, worker="w0", request_id=f"r{t}"))
        w.write(snap(t, "w0"))
    w.close()
    with open(tmp_path / "worker-2.jsonl", "w") as fh:  # a second process, killed in the middle of its snapshot
        torn = snap(2.0, "w1").to_json()[:60]
        assert '"kind":"inflight"' in torn  # cut after its kind: read as a snapshot, and found torn
        fh.write(snap(1.0, "w1").to_json() + "\n" + snap(1.5, "w1").to_json() + "\n" + torn)
    assert [r.kind for r in read_records(tmp_path)] == ["request"] * 3
    live = read_records(tmp_path, in_flight=True)
    assert sorted((r.worker, r.t) for r in live if r.kind == IN_FLIGHT) == [("w0", 2.0), ("w1", 1.5)]
    assert live[-1].ids == ["w0-2.0"] and live[-1].firsts == [None]
    assert [r.t for r in read_records(tmp_path, kind=IN_FLIGHT)] == [1.5, 2.0]


def test_level_windows_chain_levels():
    recs = [Record(kind="level", t=1.0, users=0), Record(kind="level", t=2.0, users=5),
            Record(kind="level", t=6.0, users=9), Record(t_send=6.5, t_end=8.0, status=200)]
    assert level_windows(recs) == [(0, 1.0, 2.0), (5, 2.0, 6.0), (9, 6.0, 8.0)]


def _lag(worker, lag, cpu, t):
    return Record(kind="lag", worker=worker, lag_ms=lag, cpu=cpu, t=t)


def test_client_health_flags_lag_and_cpu_but_ignores_the_master():
    healthy = [_lag("w0", 3.0, 0.3, t) for t in range(10)] + [_lag("master", 80.0, 1.0, 1)]
    h = client_health(healthy)
    assert not h.saturated and h.processes == 1 and h.lag_p99_ms == 3.0
    laggy = healthy + [_lag("w1", 40.0 if t % 3 else 2.0, 0.5, t) for t in range(10)]
    h = client_health(laggy)
    assert h.saturated and "loop lag" in h.reason and h.processes == 2
    busy = [_lag("w0", 2.0, 0.97, t) for t in range(5)]
    assert client_health(busy).saturated
    # a window restricted to the healthy seconds
    mixed = [_lag("w0", 2.0, 0.2, t) for t in range(5)] + [_lag("w0", 50.0, 0.2, t) for t in range(5, 10)]
    assert not client_health(mixed, 0, 4).saturated and client_health(mixed, 5, 9).saturated
    assert client_health([]).processes == 0


def test_importing_the_load_package_does_not_import_locust():
    # In a fresh interpreter: other tests in this process may have imported locust themselves.
    code = ("import sys, kvprobe.load.ramps, kvprobe.load.records, kvprobe.load.runner, kvprobe.load.shape; "
            "print('locust' in sys.modules, 'gevent' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
