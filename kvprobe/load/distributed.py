"""Locust's master and its remote workers, wired for kvprobe (imported by the locustfile only).

This module runs inside the Locust process (gevent). The pure parts — batching, filing, per-worker
state — are in `kvprobe.load.messages`; here they are attached to Locust's runners:

- a worker in message mode (`--kv-transport message`, what `kvprobe worker` starts) sends its
  records in batches, and on `kv_stop` stops its users and sends a final batch;
- a master expecting workers (`--kv-expect-workers N`) files every batch, writes a `worker` record
  when one connects, sends its final batch, or is lost (no heartbeat: locust 2.47.0 runners.py
  `heartbeat_worker` marks it `missing` after HEARTBEAT_LIVENESS = 3 missed 1 s beats; or it quit),
  and, when the test stops, asks every worker for its final batch and waits for them (bounded).
"""

from __future__ import annotations

import os
import socket
import time

import gevent

import kvprobe
from kvprobe.load.messages import (
    FINAL_WAIT,
    RECORDS_MSG,
    STOP_MSG,
    MessageSink,
    RecordCollector,
    worker_label,
)

WATCH_INTERVAL = 0.5
MISSING = "missing"  # locust.runners.STATE_MISSING


def worker_sink(environment, label: str) -> MessageSink:
    """The record sink of a worker that shares no folder with its master."""
    runner = environment.runner
    meta = {"label": label, "host": socket.gethostname(), "pid": os.getpid(), "version": kvprobe.__version__}
    return MessageSink(lambda data: runner.send_message(RECORDS_MSG, data), lambda: dict(meta))


def setup_worker(environment, *, on_stop) -> None:
    """`kv_stop` from the master: stop the users now (`on_stop` then records the in-flight requests
    as aborted and sends the final batch)."""

    def _stop(environment, msg, **_kw):
        environment.runner.stop()
        on_stop()

    environment.runner.register_message(STOP_MSG, _stop)


class MasterSide:
    """The master's collector, its watch over the workers, and the stop handshake."""

    def __init__(self, environment, records_dir: str, events_writer):
        self.runner = environment.runner
        self.collector = RecordCollector(records_dir, events_writer,
                                         label_of=lambda cid: worker_label(self.runner.get_worker_index(cid)))
        self.stopping = False
        self.runner.register_message(RECORDS_MSG, self._on_records)
        environment.events.worker_connect.add_listener(self._on_connect)
        environment.events.test_stopping.add_listener(self._on_test_stopping)
        gevent.spawn(self._watch)

    def _on_connect(self, client_id: str, **_kw) -> None:
        self.collector.connected(client_id)

    def _on_records(self, environment, msg, **_kw) -> None:
        self.collector.receive(msg.node_id, msg.data or {})

    def _watch(self) -> None:
        """A worker gone before the end makes the level's load wrong: say which, once."""
        while True:
            gevent.sleep(WATCH_INTERVAL)
            if self.stopping:
                continue
            for cid, w in list(self.collector.workers.items()):
                if w.lost:
                    continue
                node = self.runner.clients.get(cid)
                if node is None:
                    self.collector.lose(cid, "the worker quit before the end of the load")
                elif node.state == MISSING:
                    self.collector.lose(cid, "no heartbeat for 3 s: the worker was killed, or its host or "
                                             "network failed")

    def _on_test_stopping(self, **_kw) -> None:
        """Ask every live worker for its last records; wait (bounded) until each has sent them."""
        if self.stopping:
            return
        self.stopping = True
        live = [n.id for n in self.runner.clients.all if n.state != MISSING]
        for cid in live:
            self.runner.send_message(STOP_MSG, None, client_id=cid)
        deadline = time.monotonic() + FINAL_WAIT
        while self.collector.waiting_for_final(live) and time.monotonic() < deadline:
            gevent.sleep(0.05)

    def close(self) -> None:
        self.collector.close()
