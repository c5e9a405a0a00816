"""The record transport of remote workers, without Locust: batching, the memory bound, the filing."""

from __future__ import annotations

import pytest

from kvprobe.load.health import client_health
from kvprobe.load.messages import MessageSink, RecordCollector, host_of, split_host_port
from kvprobe.load.records import Record, read_records


def test_a_sink_sends_bounded_batches_and_marks_the_last_one_final():
    sent = []
    sink = MessageSink(sent.append, lambda: {"label": "w1", "host": "h"}, batch_max=3, buffer_max=100)
    for i in range(7):
        sink.write(Record(t_send=float(i), status=200, worker="w1"))
    sink.flush()
    assert [len(m["records"]) for m in sent] == [3, 3, 1] and not any(m["final"] for m in sent)
    assert all(m["label"] == "w1" and m["host"] == "h" for m in sent)
    sink.write(Record(t_send=7.0, status="aborted"))
    sink.flush(final=True)
    assert sent[-1]["final"] and [r["t_send"] for r in sent[-1]["records"]] == [7.0]
    sink.flush(final=True)  # nothing buffered: an empty final batch still says "all sent"
    assert isinstance(sent[-1].pop("sent_at"), float)  # the worker's clock, for the skew
    assert sent[-1] == {"label": "w1", "host": "h", "records": [], "dropped": 0, "final": True}
    assert sink.sent == 8


def test_a_sink_whose_master_does_not_read_keeps_the_newest_and_counts_the_rest():
    sent = []
    sink = MessageSink(sent.append, dict, batch_max=1000, buffer_max=5)
    for i in range(12):
        sink.write(Record(t_send=float(i)))
    assert len(sink) == 5 and sink.dropped == 7
    sink.close()
    assert [r["t_send"] for r in sent[0]["records"]] == [7.0, 8.0, 9.0, 10.0, 11.0]
    assert sent[0]["dropped"] == 7 and sent[0]["final"]


def test_the_collector_files_each_worker_and_says_connected_final_and_lost(tmp_path):
    from kvprobe.load.records import RecordWriter

    events = RecordWriter(tmp_path / "master-1.jsonl")
    labels = {"hostA_" + "a" * 32: "w0", "hostB_" + "b" * 32: "w1"}
    col = RecordCollector(tmp_path, events, label_of=labels.__getitem__)
    a, b = labels
    col.connected(a)
    col.connected(b)
    col.connected(a)  # a re-sent client_ready is no second connection
    col.receive(a, {"records": [Record(t_send=1.0, status=200, worker="w0").to_dict()] * 3, "pid": 11})
    col.receive(a, {"records": [Record(t_send=2.0, status="aborted", worker="w0").to_dict()], "final": True})
    col.receive(b, {"records": [Record(t_send=1.5, status=200, worker="w1").to_dict()]})
    col.lose(b, "no heartbeat")
    col.lose(b, "no heartbeat")  # said once
    col.close()
    events.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["master-1.jsonl", "msg-w0.jsonl", "msg-w1.jsonl"]
    recs = read_records(tmp_path)
    assert sum(r.kind == "request" and r.worker == "w0" for r in recs) == 4
    ev = [(r.worker, r.host, r.status) for r in recs if r.kind == "worker"]
    assert ev == [("w0", "hostA", "connected"), ("w1", "hostB", "connected"), ("w0", "hostA", "final"),
                  ("w1", "hostB", "lost")]
    assert col.waiting_for_final([a, b]) == []  # final or lost: nothing left to wait for
    c = "hostC_" + "c" * 32
    labels[c] = "w2"
    col.refuse(c, 2)
    col.lose(c, "quit")  # a worker sent home is not lost
    assert col.workers[c].refused and not col.workers[c].lost and col.waiting_for_final([c]) == []
    assert host_of("plainid") == "plainid"


@pytest.mark.parametrize("text, want", [("10.0.0.5:5557", ("10.0.0.5", 5557)), ("loadhost", ("loadhost", None)),
                                        ("[::1]:80", ("::1", 80))])
def test_host_port(text, want):
    assert split_host_port(text) == want


@pytest.mark.parametrize("text", ["h:0", "h:70000", "h:x", ":5557", "a b:1"])
def test_host_port_refuses(text):
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_host_port(text)


def _lag(worker, lag, cpu, t, host):
    return Record(kind="lag", worker=worker, lag_ms=lag, cpu=cpu, t=t, host=host)


def test_health_is_per_worker_and_the_saturated_one_is_named():
    recs = ([_lag("w0", 3.0, 0.3, t, "hostA") for t in range(6)] + [_lag("w1", 42.0, 0.5, t, "hostB") for t in range(6)]
            + [_lag("w2", 2.0, 0.95, t, "hostC") for t in range(6)] + [_lag("master", 90.0, 1.0, 1, "m")])
    h = client_health(recs)
    assert h.saturated and h.processes == 3
    assert [(w.worker, w.host, w.saturated) for w in h.workers] == [("w0", "hostA", False), ("w1", "hostB", True),
                                                                   ("w2", "hostC", True)]
    assert "worker w1 on hostB: loop lag p99 42.0 ms > 15 ms" in h.reason
    assert "worker w2 on hostC: a load process used 0.95 cores" in h.reason and "(2 of 3 load processes)" in h.reason
    assert not client_health(recs[:6]).saturated


def test_a_worker_clock_off_the_probes_is_measured_and_warned_about(tmp_path):
    import time

    from kvprobe.load.records import RecordWriter
    from kvprobe.load.runner import LocustRun

    records = tmp_path / "locust" / "records"
    events = RecordWriter(records / "master-1.jsonl")
    col = RecordCollector(records, events, label_of=lambda cid: "w0" if cid.startswith("near") else "w1")
    near, far = "near_" + "a" * 32, "far_" + "b" * 32
    now = time.time()
    col.receive(near, {"records": [], "sent_at": now - 0.002})
    col.receive(far, {"records": [], "sent_at": now + 0.7})  # this host's clock runs 0.7 s ahead
    col.receive(far, {"records": [], "sent_at": time.time() + 0.5, "final": True})  # a slow batch: the max wins
    col.receive(near, {"records": [], "sent_at": time.time(), "final": True})
    events.close()
    assert abs(col.workers[near].clock_offset) < 0.05 and 0.6 < col.workers[far].clock_offset < 0.75
    run = LocustRun("http://127.0.0.1:9", model="m", prompt_tokens=4, output_tokens=4, workdir=tmp_path / "locust",
                    expect_workers=2)
    (warning,) = run.clock_warnings()
    assert warning.startswith("worker w1 on far: its clock runs +0.") and "synchronise the clocks" in warning
