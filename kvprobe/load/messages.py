"""Records over Locust's own messaging: what a remote worker sends, and how its master files it.

A worker started with `kvprobe worker --master HOST:PORT` may run on another machine: it shares no
folder with the probe. Its request, loop-lag and (none: the master writes those) level records
travel to the master in batches over the master/worker ZeroMQ link Locust already holds
(`runner.send_message` on the worker, `runner.register_message` on the master; locust 2.47.0
runners.py `WorkerRunner.send_message`, `MasterRunner.handle_message` `case _ if lc := ...`). The
master writes them to its records folder, one file per worker, which the probe reads as before.

Messages (type: data)

- ``kv_records`` worker → master: ``{"label", "host", "pid", "version", "records": [dict, ...],
  "dropped": int, "final": bool, "sent_at": epoch s}``. ``final`` says every record of that worker
  has been sent; ``sent_at`` (the worker's clock) bounds the skew between the two hosts' clocks.
- ``kv_stop`` master → worker: stop your users now (their in-flight requests are recorded as
  aborted), send what is left, then a final batch. The master waits for every final batch (bounded)
  before it quits, because Locust's own quit gives workers only 0.5 s (runners.py `MasterRunner.quit`).
- ``kv_level`` master → worker: ``{"users", "start_jitter"}``: the global user count, and the spread (s)
  of the first requests of the level's new users.
- ``kv_hello`` worker → master: ``{"label", "host", "pid", "version"}`` once its handlers are
  registered (a message sent before that is dropped as unknown by Locust).
- ``kv_refused`` master → worker: ``{"expect": N}``: the master already has its N workers; followed
  by Locust's own ``quit``. A worker beyond N would break the request numbering (request k of worker
  i is ``seq * N + i``: distinct prompts from the first token need i < N).

No gevent or Locust here: the probe and the tests import this module.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvprobe.load.records import Record, RecordWriter

RECORDS_MSG = "kv_records"
STOP_MSG = "kv_stop"
REFUSED_MSG = "kv_refused"
HELLO_MSG = "kv_hello"

# A batch holds at most this many records: one message stays well under a MB of msgpack (a request
# record is ~200 B), so a burst never stalls the link that also carries Locust's heartbeats.
BATCH_MAX = 2000
# A worker whose master does not read keeps at most this many records (~10 MB), dropping the oldest
# and counting them: memory is bounded whatever the master does.
BUFFER_MAX = 50_000
# What the master waits, after asking its workers to stop, for their final batches.
FINAL_WAIT = 5.0


def worker_label(index: int | None) -> str:
    """The label a worker's records carry: its Locust worker index, given by the master on connect."""
    return f"w{index if index is not None and index >= 0 else 0}"


def host_of(client_id: str) -> str:
    """Locust names a worker `<hostname>_<uuid hex>` (runners.py `WorkerRunner.__init__`)."""
    head, sep, tail = client_id.rpartition("_")
    return head if sep and len(tail) == 32 else client_id


class MessageSink:
    """A worker's record sink: buffered like RecordWriter, flushed as `kv_records` messages.

    `send(data)` hands one message to Locust; `meta` (label, host, pid, version) goes with every batch.
    """

    def __init__(self, send: Callable[[dict], None], meta: Callable[[], dict], *, batch_max: int = BATCH_MAX,
                 buffer_max: int = BUFFER_MAX):
        self._send = send
        self._meta = meta
        self.batch_max = int(batch_max)
        self._buf: deque[dict] = deque(maxlen=int(buffer_max))
        self.dropped = 0  # records lost to the bound, reported with every later batch
        self.sent = 0
        self.final_sent = False

    def write(self, rec: Record | dict) -> None:
        if len(self._buf) == self._buf.maxlen:
            self.dropped += 1  # deque(maxlen) drops the oldest on append
        self._buf.append(rec.to_dict() if isinstance(rec, Record) else dict(rec))

    def __len__(self) -> int:
        return len(self._buf)

    def flush(self, *, final: bool = False) -> None:
        """Send everything buffered, in batches of at most `batch_max`; `final` marks the last one."""
        while self._buf or final:
            n = min(self.batch_max, len(self._buf))
            batch = [self._buf.popleft() for _ in range(n)]
            last = not self._buf
            self._send({**self._meta(), "records": batch, "dropped": self.dropped, "final": bool(final and last),
                        "sent_at": time.time()})
            self.sent += n
            if last:
                self.final_sent = self.final_sent or final
                return

    def close(self) -> None:
        self.flush(final=not self.final_sent)


@dataclass
class RemoteWorker:
    """What the master knows about one connected worker."""

    client_id: str
    label: str
    host: str
    pid: int | None = None
    version: str | None = None
    records: int = 0
    dropped: int = 0
    final: bool = False
    lost: bool = False
    refused: bool = False
    last_seen: float = field(default_factory=time.time)
    # max over batches of (worker's send time - master's receive time): the worker clock's lead,
    # short by the link's smallest latency
    clock_offset: float | None = None


class RecordCollector:
    """The master's side: files each worker's batches as `<dir>/msg-<label>.jsonl` and keeps per-worker
    state; worker events (connected, final, lost) go to `events` (the master's own record file)."""

    def __init__(self, directory: str | Path, events: RecordWriter | None,
                 label_of: Callable[[str], str] = lambda cid: cid):
        self.directory = Path(directory)
        self.events = events
        self.label_of = label_of
        self.workers: dict[str, RemoteWorker] = {}
        self._writers: dict[str, RecordWriter] = {}

    def _event(self, w: RemoteWorker, status: str, detail: str | None = None) -> None:
        if self.events is not None:
            offset = None if w.clock_offset is None else round(w.clock_offset, 4)
            self.events.write(Record(kind="worker", t=time.time(), worker=w.label, host=w.host, status=status,
                                     error=detail, clock_offset=offset))
            self.events.flush()  # the probe polls for these

    def worker(self, client_id: str) -> RemoteWorker:
        w = self.workers.get(client_id)
        if w is None:
            w = self.workers[client_id] = RemoteWorker(client_id, self.label_of(client_id), host_of(client_id))
        return w

    def connected(self, client_id: str) -> None:
        """Said once per worker: Locust fires worker_connect again when a worker re-sends client_ready
        (after a `stop`, runners.py `WorkerRunner.handle_message`)."""
        if client_id not in self.workers:
            self._event(self.worker(client_id), "connected", client_id)

    def hello(self, client_id: str, data: dict) -> None:
        w = self.worker(client_id)
        w.pid = data.get("pid", w.pid)
        w.version = data.get("version", w.version)
        w.host = data.get("host") or w.host

    def receive(self, client_id: str, data: dict) -> None:
        w = self.worker(client_id)
        if w.refused:
            return  # sent home before any load: its loop-lag seconds are not the probe's client
        w.last_seen = time.time()
        if isinstance(data.get("sent_at"), (int, float)):
            lead = float(data["sent_at"]) - w.last_seen
            w.clock_offset = lead if w.clock_offset is None else max(w.clock_offset, lead)
        w.pid = data.get("pid", w.pid)
        w.version = data.get("version", w.version)
        w.host = data.get("host") or w.host
        records = data.get("records") or []
        writer = self._writers.get(w.label)
        if writer is None and records:
            writer = self._writers[w.label] = RecordWriter(self.directory / f"msg-{w.label}.jsonl")
        for rec in records:
            writer.write(rec)
        if writer is not None:
            writer.flush()
        w.records += len(records)
        if data.get("dropped", 0) > w.dropped:
            w.dropped = int(data["dropped"])
        if data.get("final") and not w.final:
            w.final = True
            detail = f"{w.records} records" + (f", {w.dropped} dropped (buffer full)" if w.dropped else "")
            self._event(w, "final", detail)

    def refuse(self, client_id: str, expect: int) -> None:
        """One worker more than expected: sent home, and said."""
        w = self.worker(client_id)
        w.refused = True
        self._event(w, "refused", f"more workers than workers.expect ({expect}) connected; this one was sent home")

    def lose(self, client_id: str, why: str) -> None:
        """A worker stopped before the end (no heartbeat, or it quit): said once."""
        w = self.worker(client_id)
        if not (w.lost or w.final or w.refused):
            w.lost = True
            self._event(w, "lost", why)

    def waiting_for_final(self, client_ids) -> list[str]:
        return [c for c in client_ids if not (self.worker(c).final or self.worker(c).lost or self.worker(c).refused)]

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


def split_host_port(text: str, *, default_port: int | None = None) -> tuple[str, int | None]:
    """`HOST:PORT`, `HOST`, `[v6]:PORT` -> (host, port). ValueError names what was expected."""
    text = str(text).strip()
    host, port = text, None
    if text.startswith("["):
        inner, _, rest = text[1:].partition("]")
        host, port = inner, rest[1:] if rest.startswith(":") else (None if not rest else "bad")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    if not host or any(c.isspace() for c in host):
        raise ValueError("HOST:PORT with a host name or address")
    if port is None:
        return host, default_port
    if not str(port).isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("HOST:PORT with a port from 1 to 65535")
    return host, int(port)
