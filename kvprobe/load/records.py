"""Request, loop-lag, level, in-flight and worker records: one JSON object per line, one file per Locust process.

The kinds share one dataclass so the parent reads every file the same way:

- ``kind="request"``: one per request — t_send, t_first (first content chunk), t_end (epoch seconds),
  status (HTTP code, or an error kind such as ``"usage_mismatch"``), error text, the usage counts,
  ``users`` (the global target user count when it was sent), worker and request id.
- ``kind="lag"``: once a second per process — ``lag_ms`` (p99 oversleep of a 10 ms sleep during that
  second), ``lag_max_ms``, ``cpu`` (process CPU in cores over that second).
- ``kind="level"``: written by the process running the shape when Locust has actually reached a new
  user count — ``t`` (spawning complete), ``t_set`` (the tick that asked for it), ``users``.
- ``kind="inflight"``: written by each load process at every flush, after the requests that ended
  since the last one — ``t`` and, for every request sent and not yet ended then, its ``request_id``
  (``ids``), ``t_send`` (``sends``) and ``t_first`` (``firsts``, null before its first token). A reader
  that merges a process's latest one with its request records sees every request up to ``t``, not only
  those that have ended (`kvprobe.analysis.live`).
- ``kind="worker"``: written by a master that waits for workers (`kvprobe worker`) — ``t``, ``worker``
  (its label, ``w<index>``), ``host``, ``status`` (``connected``, ``final``: every record sent,
  ``lost``: no heartbeat or quit before the end), ``error`` (detail), and on ``final``
  ``clock_offset`` (s): how far ahead of the master's clock the worker's runs, to within the link's
  latency — its records carry its own clock's times.

Lag and worker records carry ``host``, the load host's name, so a saturated or lost worker is named.

No gevent or Locust here: the parent (pytest, the probe) imports this module.
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path

RECORD_SUFFIX = ".jsonl"

# Error kinds used as `status` when there is no usable HTTP status.
# The token ids of the load's prompts: the first id of request k is TOKEN_BASE + k mod TOKEN_RANGE
# (unique from the first token, so no prefix cache can help); all stay below 32,000, the smallest
# vocabulary of the presets, so a real engine never refuses them as out of vocabulary.
TOKEN_BASE = 1000
TOKEN_RANGE = 30_000
USAGE_MISMATCH = "usage_mismatch"
NO_USAGE = "no_usage"
CONNECTION = "connection"
READ_ERROR = "read_error"
ABORTED = "aborted"          # the user was stopped mid-request (ramp down, quit)
EXCEPTION = "exception"


@dataclass
class Record:
    t_send: float | None = None
    t_first: float | None = None
    t_end: float | None = None
    status: int | str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    users: int | None = None
    worker: str | None = None
    kind: str = "request"
    request_id: str | None = None
    # lag / level records
    t: float | None = None
    lag_ms: float | None = None
    lag_max_ms: float | None = None
    cpu: float | None = None
    t_set: float | None = None
    host: str | None = None  # the load host (lag and worker records)
    clock_offset: float | None = None  # worker records: how far the worker's clock runs ahead (s, about)
    # inflight records: the requests in flight at `t`, as parallel lists
    ids: list[str] | None = None
    sends: list[float] | None = None
    firsts: list[float | None] | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "request" and self.status == 200

    @property
    def ttft(self) -> float | None:
        if self.t_first is None or self.t_send is None:
            return None
        return self.t_first - self.t_send

    @property
    def time(self) -> float:
        """The record's position on the time axis (send time for requests)."""
        v = self.t_send if self.kind == "request" else self.t
        return float(v) if v is not None else 0.0

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> Record:
        known = _FIELD_NAMES
        return cls(**{k: v for k, v in d.items() if k in known})


_FIELD_NAMES = frozenset(f.name for f in fields(Record))
IN_FLIGHT = "inflight"  # the kind of a load process's snapshot of its requests in flight
_SNAPSHOT_MARK = f'"kind":"{IN_FLIGHT}"'  # as every writer here spells it (compact JSON)
# How often a load process writes its finished requests and a snapshot of those in flight: a reader sees a
# request at most this long after it ends, and one in flight at most this long after it was sent.
FLUSH_SECONDS = 0.5


class RecordWriter:
    """Buffered JSONL sink; the owner calls flush() regularly and close() on quit.

    Lines are buffered in memory and written in one call so a killed process loses at most the
    last flush interval, and a partly written last line is skipped by `read_records`.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._buf: list[str] = []

    def write(self, rec: Record | dict) -> None:
        line = rec.to_json() if isinstance(rec, Record) else json.dumps(rec, separators=(",", ":"))
        if self._fh is None:
            # After close (a greenlet finishing during shutdown): append directly, never drop.
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
            return
        self._buf.append(line)

    def flush(self) -> None:
        if self._buf and self._fh is not None:
            buf, self._buf = self._buf, []
            self._fh.write("\n".join(buf) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self.flush()
            self._fh.close()
            self._fh = None


def read_record_file(path: str | os.PathLike, *, in_flight: bool = False) -> list[Record]:
    """The records of one process's file; of its in-flight snapshots only the latest whole one, and only
    with `in_flight` (each supersedes the one before, and a long run writes thousands: they are told
    apart by their text, not parsed)."""
    out: list[Record] = []
    snapshots: deque[str] = deque(maxlen=2)  # the last one may be torn
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            if _SNAPSHOT_MARK in line:
                if in_flight:
                    snapshots.append(line)
                continue
            try:
                out.append(Record.from_dict(json.loads(line)))
            except (ValueError, TypeError):
                # A process killed mid-write leaves at most one torn line; skip it.
                continue
    for line in reversed(snapshots):
        try:
            out.append(Record.from_dict(json.loads(line)))
            break
        except (ValueError, TypeError):
            continue
    return out


def read_records(directory: str | os.PathLike, *, kind: str | None = None, in_flight: bool = False) -> list[Record]:
    """The records of every process file in `directory`, ordered by time: those of `kind`, or all of them
    but the in-flight snapshots unless `in_flight` (a live reader's: each process's latest; once the load
    has stopped every request has its own record)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    recs: list[Record] = []
    for p in sorted(d.glob("*" + RECORD_SUFFIX)):
        recs.extend(read_record_file(p, in_flight=in_flight or kind == IN_FLIGHT))
    if kind is not None:
        recs = [r for r in recs if r.kind == kind]
    recs.sort(key=lambda r: r.time)
    return recs


def level_windows(records: list[Record], t_stop: float | None = None) -> list[tuple[int, float, float]]:
    """(users, t_start, t_end) per level from the level records: a level lasts until the next one.

    The last level ends at `t_stop` (default: the last request end seen).
    """
    levels = sorted((r for r in records if r.kind == "level"), key=lambda r: r.time)
    if t_stop is None:
        ends = [r.t_end for r in records if r.kind == "request" and r.t_end is not None]
        t_stop = max(ends) if ends else (levels[-1].time if levels else 0.0)
    out = []
    for i, lv in enumerate(levels):
        end = levels[i + 1].time if i + 1 < len(levels) else t_stop
        out.append((int(lv.users or 0), lv.time, max(end, lv.time)))
    return out
