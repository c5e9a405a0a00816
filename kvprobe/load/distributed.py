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
import sys
import time

import gevent

import kvprobe
from kvprobe.load.messages import (
    FINAL_WAIT,
    HELLO_MSG,
    RECORDS_MSG,
    REFUSED_MSG,
    STOP_MSG,
    MessageSink,
    RecordCollector,
    worker_label,
)

WATCH_INTERVAL = 0.5
MISSING = "missing"  # locust.runners.STATE_MISSING


def _meta(label: str) -> dict:
    return {"label": label, "host": socket.gethostname(), "pid": os.getpid(), "version": kvprobe.__version__}


def worker_sink(environment, label: str) -> MessageSink:
    """The record sink of a worker that shares no folder with its master."""
    runner = environment.runner
    meta = _meta(label)
    return MessageSink(lambda data: runner.send_message(RECORDS_MSG, data), lambda: dict(meta))


def setup_worker(environment, label: str, *, on_stop) -> None:
    """`kv_stop` from the master: stop the users now (`on_stop` then records the in-flight requests
    as aborted and sends the final batch). `kv_refused`: say why the master sends this one home."""

    def _stop(environment, msg, **_kw):
        environment.runner.stop()
        on_stop()

    def _refused(environment, msg, **_kw):
        n = (msg.data or {}).get("expect")
        print(f"kvprobe worker: the master already has the {n} worker(s) its profile expects (workers.expect); "
              "this one is not needed and exits", file=sys.stderr, flush=True)

    environment.runner.register_message(STOP_MSG, _stop)
    environment.runner.register_message(REFUSED_MSG, _refused)
    environment.runner.send_message(HELLO_MSG, _meta(label))  # now the master may talk to it


class MasterSide:
    """The master's collector, its watch over the workers, and the stop handshake."""

    def __init__(self, environment, records_dir: str, events_writer, expect: int):
        self.runner = environment.runner
        self.expect = int(expect)
        self.collector = RecordCollector(records_dir, events_writer,
                                         label_of=lambda cid: worker_label(self.runner.get_worker_index(cid)))
        self.stopping = False
        self.runner.register_message(RECORDS_MSG, self._on_records)
        self.runner.register_message(HELLO_MSG, self._on_hello)
        environment.events.worker_connect.add_listener(self._on_connect)
        environment.events.test_stopping.add_listener(self._on_test_stopping)
        gevent.spawn(self._watch)

    def _extra(self, client_id: str) -> bool:
        # Locust takes any number of workers (--expect-workers is a minimum); kvprobe's request
        # numbering needs exactly `expect`.
        return self.runner.get_worker_index(client_id) >= self.expect

    def _on_connect(self, client_id: str, **_kw) -> None:
        if not self._extra(client_id):
            self.collector.connected(client_id)

    def _on_hello(self, environment, msg, **_kw) -> None:
        """A worker ready for kvprobe's messages; one beyond `expect` is sent home (Locust rebalances
        when a worker quits: runners.py `MasterRunner.handle_message` "quit")."""
        from locust.rpc import Message

        self.collector.hello(msg.node_id, msg.data or {})
        if self._extra(msg.node_id) and not self.collector.worker(msg.node_id).refused:
            self.collector.refuse(msg.node_id, self.expect)
            self.runner.send_message(REFUSED_MSG, {"expect": self.expect}, client_id=msg.node_id)
            self.runner.server.send_to_client(Message("quit", None, msg.node_id))

    def _on_records(self, environment, msg, **_kw) -> None:
        self.collector.receive(msg.node_id, msg.data or {})

    def _watch(self) -> None:
        """A worker gone before the end makes the level's load wrong: say which, once."""
        while True:
            gevent.sleep(WATCH_INTERVAL)
            if self.stopping:
                continue
            for cid, w in list(self.collector.workers.items()):
                if w.lost or w.refused:
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
