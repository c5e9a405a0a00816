"""LocustRun: the Locust subprocess (one process, or a master with N workers) driven by a control file.

Locust runs as a subprocess so its gevent monkey-patching (locust/__init__.py, on import) never reaches the caller.
The parent writes the control file, Locust's shape follows it once a second, and every process
writes its own JSONL records, read back with `records()`. Everything runs in one process group
the parent owns; stop = control-file stop, then SIGTERM to the group, then SIGKILL — every wait
has a deadline.

With `expect_workers` the subprocess is a bare master: it starts no load process of its own and
waits for that many `kvprobe worker --master HOST:PORT` processes, on this or other hosts; their
records reach the master over Locust's messaging (`kvprobe.load.messages`) and land in the same
records folder, so everything below reads them as it reads local ones.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import kvprobe
from kvprobe.engines import get_dialect
from kvprobe.errors import ConfigError, ProbeError
from kvprobe.load.health import CPU_SATURATED, LAG_SATURATED_MS, ClientHealth, WorkerHealth, client_health  # noqa: F401
from kvprobe.load.records import (
    RECORD_SUFFIX,
    TOKEN_BASE,
    TOKEN_RANGE,
    Record,
    read_record_file,
    read_records,
)
from kvprobe.load.shape import default_spawn_rate, write_control
from kvprobe.procgroup import free_port, group_members, signal_group, stop_group, wait_group_gone  # noqa: F401

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
# A worker's clock this far off the probe's moves its records across a level's edges noticeably
# (levels last seconds; warm-up discards the first 30%).
CLOCK_SKEW_WARN_S = 0.25

class LocustRun:
    """One Locust run against `url`; see the module doc. Use as a context manager or call stop()."""

    def __init__(self, url: str, *, model: str | None, prompt_tokens: int, output_tokens: int,
                 workdir: str | os.PathLike, api_key_env: str | None = None, processes: int = 1, seed: int = 0,
                 stream: bool = True, engine: str = "vllm", time_limit: float = 600.0,
                 startup_timeout: float = 60.0, path: str | None = None, token_base: int = TOKEN_BASE,
                 token_range: int = TOKEN_RANGE, network_timeout: float = 600.0, start_jitter: float = 0.0,
                 shared_prefix_tokens: int = 0, prompt_format: str = "ids", expect_workers: int = 0,
                 bind_host: str = "127.0.0.1", bind_port: int | None = None, workers_wait: float = 60.0,
                 idle_limit: float = 0.0):
        if prompt_tokens < 1 or output_tokens < 1:
            raise ConfigError(f"prompt_tokens and output_tokens must be >= 1, got {prompt_tokens}/{output_tokens}")
        if processes < 1:
            raise ConfigError(f"processes must be >= 1, got {processes}")
        if expect_workers and processes != 1:
            raise ConfigError(f"expect_workers ({expect_workers}) starts no local load process: processes must "
                              f"be 1, got {processes}")
        self.url = url.rstrip("/")
        self.model = model
        self.prompt_tokens, self.output_tokens = int(prompt_tokens), int(output_tokens)
        self.workdir = Path(workdir).resolve()  # Locust runs with cwd=workdir: relative paths would nest
        self.api_key_env = api_key_env
        self.processes = int(processes)
        self.seed = int(seed)
        self.stream = bool(stream)
        self.engine = engine
        self.time_limit = float(time_limit)
        # > 0: started idle ahead of its load, the run waits at most this long for its first level
        # with users, and its time limit counts from that level (kvprobe.load.shape)
        self.idle_limit = float(idle_limit)
        self.startup_timeout = float(startup_timeout)
        self.path = path or get_dialect(self.engine).COMPLETIONS_PATH
        self.token_base, self.token_range = int(token_base), int(token_range)
        self.network_timeout = float(network_timeout)
        self.start_jitter = float(start_jitter)
        self.level_jitter = self.start_jitter  # the jitter of the level asked for last
        self.shared_prefix_tokens = int(shared_prefix_tokens)
        if prompt_format not in ("ids", "text"):
            raise ConfigError(f"prompt_format must be 'ids' or 'text', got {prompt_format!r}")
        self.prompt_format = prompt_format  # "text" behind a router that refuses token ids (fleet/router.py)
        if not 0 <= self.shared_prefix_tokens < self.prompt_tokens:
            raise ConfigError(f"shared_prefix_tokens must be >= 0 and < prompt_tokens ({self.prompt_tokens}), "
                              f"got {shared_prefix_tokens}")
        self.records_dir = self.workdir / "records"
        self.control_path = self.workdir / "control.json"
        self.log_path = self.workdir / "locust.log"
        self.run_id = uuid.uuid4().hex[:8]
        self.expect_workers = int(expect_workers)
        self.bind_host = bind_host
        self.workers_wait = float(workers_wait)
        # Remote workers must be told the port before the master starts: choose it now.
        self.master_port: int | None = (int(bind_port) if bind_port else free_port(_probe_host(bind_host))) \
            if self.expect_workers else None
        self._worker_cache: tuple[float, list[Record]] = (0.0, [])
        self.proc: subprocess.Popen | None = None
        self._log_fh = None
        self._stopped = False
        self._last_users = 0

    # --- lifecycle --------------------------------------------------------------------------

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
               "--loglevel", "WARNING", "--host", self.url, "--exit-code-on-error", "0",
               "--kv-control", str(self.control_path), "--kv-records-dir", str(self.records_dir),
               "--kv-time-limit", str(self.time_limit), "--kv-idle-limit", str(self.idle_limit),
               "--kv-model", self.model or "",
               "--kv-engine", self.engine, "--kv-path", self.path,
               "--kv-prompt-tokens", str(self.prompt_tokens), "--kv-output-tokens", str(self.output_tokens),
               "--kv-stream", "1" if self.stream else "0", "--kv-seed", str(self.seed), "--kv-run-id", self.run_id,
               "--kv-workers", str(self.expect_workers or self.processes), "--kv-token-base", str(self.token_base),
               "--kv-token-range", str(self.token_range), "--kv-network-timeout", str(self.network_timeout),
               "--kv-start-jitter", str(self.start_jitter),
               "--kv-shared-prefix-tokens", str(self.shared_prefix_tokens)]
        if self.prompt_format != "ids":
            cmd += ["--kv-prompt-format", self.prompt_format]
        if self.api_key_env:
            cmd += ["--kv-api-key-env", self.api_key_env]  # the name only; the key stays in the environment
        if self.expect_workers:
            # A bare master: Locust waits for the workers before it runs the shape (main.py,
            # `--expect-workers`); the probe's own deadline (workers_wait) comes first.
            cmd += ["--master", "--master-bind-host", self.bind_host, "--master-bind-port", str(self.master_port),
                    "--expect-workers", str(self.expect_workers),
                    "--expect-workers-max-wait", str(int(self.workers_wait + 30)),
                    "--kv-expect-workers", str(self.expect_workers)]
        elif self.processes > 1:
            # Fork mode binds *:5557 by default (locust/argument_parser.py) and two runs collide: bind loopback on
            # a port of our own and tell the children the same port.
            self.master_port = self.master_port or free_port()
            cmd += ["--processes", str(self.processes), "--master-bind-host", "127.0.0.1",
                    "--master-bind-port", str(self.master_port), "--master-port", str(self.master_port),
                    "--expect-workers-max-wait", str(int(self.startup_timeout))]
        return cmd

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("LOCUST_SKIP_MONKEY_PATCH", None)
        root = str(Path(kvprobe.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def start(self, *, users: int = 0) -> LocustRun:
        """Start Locust and wait (bounded) until its shape has applied the first level."""
        if self.proc is not None:
            raise ProbeError("LocustRun.start() called twice")
        self.records_dir.mkdir(parents=True, exist_ok=True)
        for old in self.records_dir.glob("*" + RECORD_SUFFIX):
            old.unlink()  # a reused workdir must not mix runs
        write_control(self.control_path, users=int(users), spawn_rate=default_spawn_rate(users))
        self._last_users = int(users)
        self._log_fh = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        t0 = time.time()
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._log_fh,
                                     stderr=subprocess.STDOUT, start_new_session=True, env=self._env(),
                                     cwd=str(self.workdir))
        try:
            if self.expect_workers:
                self.wait_workers(timeout=self.workers_wait)
            self.wait_level(users, since=t0, timeout=self.startup_timeout)
        except ProbeError:
            self.stop(timeout=5)
            raise
        return self

    def set_users(self, n: int, spawn_rate: float | None = None, *, start_jitter: float | None = None) -> None:
        """Ask Locust for `n` users; `start_jitter` (s) spreads this level's new users' first requests
        in place of the run's `start_jitter` (`level_jitter` says which is in force)."""
        if n < 0:
            raise ConfigError(f"user count must be >= 0, got {n}")
        if start_jitter is not None and not start_jitter >= 0:
            raise ConfigError(f"start jitter must be >= 0 seconds, got {start_jitter!r}")
        # A rate of at least the change makes Locust apply the whole step at once (its dispatcher
        # moves `spawn_rate` users per second, ramping down too).
        rate = spawn_rate or max(default_spawn_rate(n), float(abs(n - self._last_users)))
        # the jitter in force travels with every level: `start_jitter` may have been set after the
        # process started with its own (a probe's client starts before its request is timed)
        jitter = self.start_jitter if start_jitter is None else float(start_jitter)
        write_control(self.control_path, users=int(n), spawn_rate=float(rate), start_jitter=jitter)
        self._last_users = int(n)
        self.level_jitter = self.start_jitter if start_jitter is None else float(start_jitter)

    def level_records(self) -> list[Record]:
        out: list[Record] = []
        for p in self.records_dir.glob("*" + RECORD_SUFFIX):
            if p.name.startswith(("local-", "master-")):
                out.extend(r for r in read_record_file(p) if r.kind == "level")
        out.sort(key=lambda r: r.time)
        return out

    def wait_level(self, n: int, *, since: float | None = None, timeout: float = 30.0) -> float:
        """Wait until Locust has reached `n` users; returns the level record's time (epoch s).

        The level record is written when spawning completes. The latest level record is the truth:
        if Locust was already at `n` (no new level was needed) its record is returned. `since` is
        accepted for callers that note when they asked; it does not filter.
        """
        deadline = time.monotonic() + timeout
        while True:
            levels = self.level_records()
            if levels and levels[-1].users == n:
                return levels[-1].time
            self.raise_if_worker_lost()
            if not self.alive():
                raise ProbeError(f"Locust exited (rc={self.returncode}) before reaching {n} users: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise ProbeError(f"Locust did not reach {n} users within {timeout:g} s: {self.log_tail()}")
            time.sleep(0.05)

    # --- remote workers ---------------------------------------------------------------------

    @property
    def master_address(self) -> str:
        """HOST:PORT a worker connects to (a wildcard bind is reached by this host's name)."""
        host = self.bind_host if self.bind_host not in ("0.0.0.0", "::", "*", "") else socket.gethostname()
        return f"{host}:{self.master_port}"

    def worker_command(self) -> str:
        return f"kvprobe worker --master {self.master_address}"

    def worker_records(self) -> list[Record]:
        """The master's `worker` records (connected, final, lost), read at most every 0.5 s."""
        t, cached = self._worker_cache
        if time.monotonic() - t < 0.5:
            return cached
        out: list[Record] = []
        for p in self.records_dir.glob("master-*" + RECORD_SUFFIX):
            out.extend(r for r in read_record_file(p) if r.kind == "worker")
        out.sort(key=lambda r: r.time)
        self._worker_cache = (time.monotonic(), out)
        return out

    def connected_workers(self) -> list[Record]:
        seen: dict[str, Record] = {}
        for r in self.worker_records():
            if r.status == "connected":
                seen[r.worker] = r
        return list(seen.values())

    def clock_warnings(self, limit_s: float = CLOCK_SKEW_WARN_S) -> list[str]:
        """Workers whose clock is off the probe host's by more than `limit_s`: their records' times
        (send, first token) are shifted against the levels and the /metrics samples by that much."""
        out = []
        for r in self.worker_records():
            if r.status == "final" and r.clock_offset is not None and abs(r.clock_offset) > limit_s:
                out.append(f"worker {r.worker} on {r.host}: its clock runs {r.clock_offset:+.3f} s from this host's "
                           "(to within the link's latency); its records are shifted by that much against the "
                           "levels: synchronise the clocks (NTP, chrony)")
        return out

    def lost_workers(self) -> list[Record]:
        return [r for r in self.worker_records() if r.status == "lost"]

    def raise_if_worker_lost(self) -> None:
        lost = self.lost_workers()
        if lost:
            names = "; ".join(f"worker {r.worker}" + (f" on {r.host}" if r.host else "") + f": {r.error}"
                              for r in lost)
            raise ProbeError(f"{len(lost)} of {self.expect_workers} Locust workers stopped during the load ({names}); "
                             "the levels they served lost their users, so nothing after this is measured")

    def wait_workers(self, *, timeout: float) -> None:
        """Wait (bounded) for `expect_workers` workers to connect to the master."""
        deadline = time.monotonic() + timeout
        while True:
            self._worker_cache = (0.0, [])
            connected = self.connected_workers()
            if len(connected) >= self.expect_workers:
                return
            if not self.alive():
                raise ProbeError(f"the Locust master exited (rc={self.returncode}) while waiting for workers: "
                                 f"{self.log_tail()}")
            if time.monotonic() > deadline:
                who = ", ".join(f"{r.worker} on {r.host}" for r in connected) or "none"
                raise ProbeError(
                    f"{len(connected)} of {self.expect_workers} Locust workers connected within {timeout:g} s "
                    f"(connected: {who}); start each missing one on a load host with: {self.worker_command()}")
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def pgid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def group_alive(self) -> bool:
        """Any live process left in the run's process group (the forked workers included)."""
        if self.proc is None:
            return False
        self.proc.poll()
        return bool(group_members(self.proc.pid, self.proc))

    def stop(self, timeout: float = 10.0) -> int | None:
        """Ask the shape to stop, then SIGTERM the group, then SIGKILL it; idempotent, bounded."""
        if self.proc is None:
            return None
        if not self._stopped:
            self._stopped = True
            deadline = time.monotonic() + timeout
            if self.alive():
                write_control(self.control_path, stop=True)
                # the shape ticks once a second; the master then tells its workers to quit
                wait_group_gone(self.proc, self.proc.pid, time.monotonic() + min(4.0, timeout / 2))
            stop_group(self.proc, self.proc.pid, grace=max(1.0, deadline - time.monotonic()))
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if self._log_fh is not None:
                self._log_fh.close()
                self._log_fh = None
        return self.proc.poll()

    def terminate(self) -> None:
        """SIGTERM only (what a supervisor would send); records are flushed by the locustfile."""
        if self.alive():
            signal_group(self.proc.pid, signal.SIGTERM)

    def __enter__(self) -> LocustRun:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- results ----------------------------------------------------------------------------

    def records(self, kind: str | None = None, *, in_flight: bool = False) -> list[Record]:
        """The load's records (`records.read_records`): those of `kind`, or all but the in-flight
        snapshots unless `in_flight`."""
        return read_records(self.records_dir, kind=kind, in_flight=in_flight)

    def client_health(self, t0: float | None = None, t1: float | None = None) -> ClientHealth:
        return client_health(self.records(), t0, t1)

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def _probe_host(bind_host: str) -> str:
    """The address to find a free port on: a wildcard bind is checked on all interfaces."""
    return "0.0.0.0" if bind_host in ("0.0.0.0", "::", "*", "") else bind_host
