"""The locustfile LocustRun starts: closed-loop fixed-length completion requests, recorded per request.

Runs only inside the Locust subprocess (it imports Locust, which monkey-patches with gevent). What
it relies on in Locust 2.47.0 and geventhttpclient:
- FastHttpUser with `resp.stream.readline` times the first token; the request goes out with
  `Accept-Encoding: identity`, since FastHttpSession asks for gzip/deflate/br by default
  (locust/contrib/fasthttp.py) and a compressed SSE body cannot be read line by line; the stream is
  read to the end of the message so the connection is reused (kvprobe.load.stream);
- `gc.freeze()` at init: Locust freezes only for `--processes` (locust/main.py), and a full gen-2
  collection otherwise stalls every greenlet for ~100 ms;
- headless, `main()` joins the shape greenlet before it installs its SIGTERM handler
  (locust/main.py `start_automatic_run`), so this file installs its own;
- `events.request` fires only on workers and the shape runs on the master (locust/runners.py).

Workers that share no folder with the master (`kvprobe worker`, `--kv-transport message`) send
their records to it over Locust's messaging and take the request settings from the master's spawn
message (locust/runners.py `WorkerRunner.handle_message` "spawn" carries every custom option);
wiring in `kvprobe.load.distributed`, the body in `kvprobe.load.body`, the reading in `kvprobe.load.stream`.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import random
import signal
import time

import gevent
from gevent import GreenletExit
from locust import FastHttpUser, constant, events, task
from locust.runners import MasterRunner, WorkerRunner

from kvprobe.load.body import body_template
from kvprobe.load.health import STALL_ENV
from kvprobe.load.locust_options import add_arguments
from kvprobe.load.loop_watch import lag_monitor, stall
from kvprobe.load.prompts import varying_ids
from kvprobe.load.records import (
    ABORTED,
    CONNECTION,
    EXCEPTION,
    FLUSH_SECONDS,
    IN_FLIGHT,
    NO_USAGE,
    READ_ERROR,
    USAGE_MISMATCH,
    Record,
    RecordWriter,
)
from kvprobe.load.shape import make_shape_class
from kvprobe.load.stream import read_stream, usage_from_tail

# (kvprobe.load.distributed is imported only by a master expecting workers or a message-mode worker)

ERROR_TEXT = 300


class _State:
    """Per-process state (each Locust process imports this file once, before any fork)."""

    writer: RecordWriter | None = None
    role = "local"
    label = "w0"
    index: int | None = None
    target_users = 0
    start_jitter = 0.0  # this level's spread of its new users' first requests (s)
    pending_level: tuple[int, float] | None = None
    level_written: int | None = None  # the user count of the last level record
    seq = itertools.count()
    inflight: dict[int, Record] = {}
    body_parts: list[bytes] | None = None
    headers: dict[str, str] = {}
    opts = None
    remote = False  # a worker sending its records to the master (no shared folder)
    master_side = None  # kvprobe.load.distributed.MasterSide on a master expecting workers


S = _State()


events.init_command_line_parser.add_listener(add_arguments)


# --- process setup ------------------------------------------------------------------------------

@events.init.add_listener
def _on_init(environment, **_kw) -> None:
    opts = environment.parsed_options
    S.opts = opts
    S.start_jitter = opts.kv_start_jitter
    runner = environment.runner
    S.role = "master" if isinstance(runner, MasterRunner) else "worker" if isinstance(runner, WorkerRunner) else "local"
    S.label = "master" if S.role == "master" else "w0"
    _configure(opts)
    S.remote = S.role == "worker" and opts.kv_transport == "message"
    if S.remote:
        from kvprobe.load import distributed

        S.writer = distributed.worker_sink(environment, _label())
        distributed.setup_worker(environment, _label(), on_stop=_final_batch)
    elif opts.kv_records_dir:
        S.writer = RecordWriter(os.path.join(opts.kv_records_dir, f"{S.role}-{os.getpid()}.jsonl"))
    if S.role == "master" and opts.kv_expect_workers > 0:
        from kvprobe.load import distributed

        S.master_side = distributed.MasterSide(environment, opts.kv_records_dir, S.writer, opts.kv_expect_workers)
    if S.role == "worker":
        runner.register_message("kv_level", _on_level_message)
    gevent.spawn(_flusher)
    gevent.spawn(lag_monitor, _write, _label)
    stall_ms = float(os.environ.get(STALL_ENV) or 0)
    if stall_ms > 0:
        gevent.spawn(stall, stall_ms / 1000.0)
    # A full gen-2 collection stalls every greenlet for ~100 ms; freeze what exists (Locust does only
    # for --processes, locust/main.py).
    gc.collect()
    gc.freeze()

    def _on_term():
        # Locust installs its own SIGTERM handler only after the shape ends (locust/main.py main()).
        environment.process_exit_code = 143
        _flush()
        environment.runner.quit()

    gevent.signal_handler(signal.SIGTERM, _on_term)


def _configure(opts) -> None:
    """The request body and headers from the options (again on a worker once the master's arrive)."""
    S.body_parts = body_template(opts)
    S.headers = {"Accept-Encoding": "identity", "Content-Type": "application/json"}
    # The NAME of the key's variable comes from the master; the key itself from this host's environment.
    key = os.environ.get(opts.kv_api_key_env) if opts.kv_api_key_env else None
    if key:
        S.headers["Authorization"] = f"Bearer {key}"


@events.test_start.add_listener
def _on_test_start(environment, **_kw) -> None:
    # On a worker, test_start fires after the first spawn message copied the master's options into
    # parsed_options and before any user starts (runners.py `WorkerRunner.handle_message` "spawn").
    if S.role == "worker":
        _configure(environment.parsed_options)


def _final_batch() -> None:
    """A message-mode worker told to stop: its in-flight requests recorded, every record sent."""
    _abort_inflight()
    if S.writer is not None:
        S.writer.flush(final=True)


def _on_level_message(environment, msg, **_kw) -> None:
    S.target_users = int(msg.data["users"])
    S.start_jitter = float(msg.data.get("start_jitter") or 0.0)


def _on_new_level(users: int, t_set: float, start_jitter: float | None = None) -> None:
    """Called by the shape (local or master) when it hands Locust a new user count. The level's
    start jitter, when the parent names one, replaces --kv-start-jitter for this level's new users;
    a master sends the jitter in force with the count, ahead of the spawn message on the same link
    (a remote worker's own --kv-start-jitter is not the master's)."""
    S.target_users = users
    S.pending_level = (users, t_set)
    S.start_jitter = S.opts.kv_start_jitter if start_jitter is None else start_jitter
    runner = _env_ref.runner if _env_ref is not None else None
    if isinstance(runner, MasterRunner):
        runner.send_message("kv_level", {"users": users, "start_jitter": S.start_jitter})


_env_ref = None


@events.init.add_listener
def _keep_env(environment, **_kw) -> None:
    global _env_ref
    _env_ref = environment


@events.spawning_complete.add_listener
def _on_spawning_complete(user_count: int, **_kw) -> None:
    t_set = S.pending_level[1] if S.pending_level and S.pending_level[0] == user_count else None
    _write_level(user_count, t_set)


def _on_idle(t: float) -> None:
    """The shape's first tick, with no users asked for: Locust runs none, which is the parent's level 0."""
    _write_level(0, t)


def _write_level(users: int, t_set: float | None) -> None:
    # once per user count: an empty start reported by the shape's first tick is not reported again
    # when Locust applies it
    if S.role == "worker" or S.writer is None or users == S.level_written:
        return
    S.level_written = users
    S.writer.write(Record(kind="level", t=time.time(), t_set=t_set, users=users, worker=S.label))
    S.writer.flush()  # the parent polls for this record


@events.quitting.add_listener
def _on_quitting(**_kw) -> None:
    _flush()


@events.quit.add_listener
def _on_quit(**_kw) -> None:
    # On SIGTERM the main greenlet can reach sys.exit while killed users have not yet run their
    # GreenletExit handler: record every request still in flight as aborted before closing.
    _abort_inflight()
    if S.writer is not None:
        S.writer.close()
    if S.master_side is not None:
        S.master_side.close()


def _finish(rec: Record) -> None:
    """Write a request record exactly once (the quit listener may have written it as aborted)."""
    if S.inflight.pop(id(rec), None) is not None and S.writer is not None:
        S.writer.write(rec)


def _abort_inflight() -> None:
    now = time.time()
    for rec in list(S.inflight.values()):
        rec.status, rec.t_end = ABORTED, now
        _finish(rec)


def _flush() -> None:
    if S.writer is not None:
        try:
            S.writer.flush()
        except ValueError:  # already closed
            pass


def _write(rec: Record) -> None:
    if S.writer is not None:
        S.writer.write(rec)


def _flusher() -> None:
    while True:
        gevent.sleep(FLUSH_SECONDS)
        _snapshot()
        _flush()


def _snapshot() -> None:
    """The requests in flight now, written after those that ended since the last flush: a live reader
    then sees every request up to now, not only those that ended a latency ago (`analysis.live`). A
    master runs no users and writes none."""
    if S.writer is None or S.role == "master":
        return
    sent = [rec for rec in S.inflight.values() if rec.t_send is not None]
    S.writer.write(Record(kind=IN_FLIGHT, t=time.time(), worker=_label(), ids=[rec.request_id for rec in sent],
                          sends=[rec.t_send for rec in sent], firsts=[rec.t_first for rec in sent]))


def _label() -> str:
    if S.role == "worker" and S.index is None and _env_ref is not None:
        idx = getattr(_env_ref.runner, "worker_index", -1)
        if idx is not None and idx >= 0:
            S.index = idx
            S.label = f"w{idx}"
    return S.label


# --- one request --------------------------------------------------------------------------------

def make_body(k: int) -> bytes:
    """The body of global request number k: the template with its two varying ids spliced in."""
    o = S.opts
    a, b = varying_ids(k, o.kv_token_base, o.kv_token_range)
    parts = S.body_parts
    if len(parts) == 2:
        return parts[0] + str(a).encode() + parts[1]
    return parts[0] + str(a).encode() + parts[1] + str(b).encode() + parts[2]


def _next_k() -> tuple[int, int]:
    """(global request number, local sequence) — the number space is partitioned by worker index."""
    _label()
    seq = next(S.seq)
    o = S.opts
    idx = S.index or 0
    return o.kv_seed * 1_000_003 + seq * max(1, o.kv_workers) + idx, seq


class ProbeUser(FastHttpUser):
    """One closed-loop user: the next request goes out when the previous one ends."""

    wait_time = constant(0)
    connection_timeout = 10.0
    concurrency = 1
    _backoff = 0.0

    def on_start(self) -> None:
        self.network_timeout = S.opts.kv_network_timeout
        if S.start_jitter > 0:
            gevent.sleep(random.uniform(0.0, S.start_jitter))

    @task
    def one_request(self) -> None:
        rec = Record(users=S.target_users, worker=_label())
        S.inflight[id(rec)] = rec
        try:
            ok = self._request(rec)
        except GreenletExit:
            rec.status, rec.t_end = ABORTED, time.time()
            _finish(rec)
            raise
        except Exception as err:  # noqa: BLE001 — one record, no traceback storm
            rec.status, rec.error, rec.t_end = EXCEPTION, f"{type(err).__name__}: {err}"[:ERROR_TEXT], time.time()
            ok = False
        _finish(rec)
        if ok:
            self._backoff = 0.0
        else:
            # A dead server must not turn into thousands of failing requests a second.
            self._backoff = min(1.0, max(0.05, self._backoff * 2))
            gevent.sleep(self._backoff)

    def _request(self, rec: Record) -> bool:
        o = S.opts
        k, seq = _next_k()
        rid = f"{o.kv_run_id}-{rec.worker}-{seq}"
        rec.request_id = rid
        headers = dict(S.headers)
        headers["X-Request-Id"] = rid
        body = make_body(k)
        stream = bool(o.kv_stream)
        rec.t_send = time.time()
        with self.client.request("POST", o.kv_path, data=body, headers=headers, stream=stream,
                                 catch_response=True, name="completion") as resp:
            code = resp.status_code or 0
            if code != 200:
                return self._failed(resp, rec, code)
            try:
                if stream:
                    rec.t_first, tail = read_stream(resp.stream, rec)
                    usage = usage_from_tail(tail)
                else:
                    payload = json.loads(resp.content or b"{}")
                    usage = payload.get("usage") if isinstance(payload, dict) else None
                    tail = resp.content or b""
            except Exception as err:  # noqa: BLE001 — a broken stream is a record, not a crash
                rec.t_end = time.time()
                rec.status, rec.error = READ_ERROR, f"{type(err).__name__}: {err}"[:ERROR_TEXT]
                resp.failure(rec.error)
                return False
            rec.t_end = time.time()
            resp.request_meta["response_time"] = (rec.t_end - rec.t_send) * 1000.0
            return self._judge(resp, rec, usage, tail)

    def _judge(self, resp, rec: Record, usage: dict | None, tail: bytes) -> bool:
        o = S.opts
        if usage is None:
            rec.status, rec.error = NO_USAGE, tail[-ERROR_TEXT:].decode(errors="replace")
            resp.failure(NO_USAGE)
            return True
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.completion_tokens = usage.get("completion_tokens")
        if rec.prompt_tokens != o.kv_prompt_tokens or rec.completion_tokens != o.kv_output_tokens:
            rec.status = USAGE_MISMATCH
            rec.error = (f"usage prompt_tokens={rec.prompt_tokens} completion_tokens={rec.completion_tokens}, "
                         f"expected {o.kv_prompt_tokens}/{o.kv_output_tokens}")
            resp.failure(rec.error)
            return True
        rec.status = 200
        resp.success()
        return True

    def _failed(self, resp, rec: Record, code: int) -> bool:
        rec.t_end = time.time()
        if code == 0:
            rec.status = CONNECTION
            rec.error = f"{type(resp.error).__name__}: {resp.error}"[:ERROR_TEXT]
        else:
            rec.status = code
            try:
                rec.error = (resp.content or b"").decode(errors="replace")[:ERROR_TEXT]
            except Exception as err:  # noqa: BLE001
                rec.error = f"HTTP {code} ({type(err).__name__})"
        resp.failure(rec.error or f"HTTP {code}")
        return False


ControlFileShape = make_shape_class(_on_new_level, _on_idle)
