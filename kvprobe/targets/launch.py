"""Bring an engine up (launch) or reach one that runs elsewhere (attach), and read what it reports.

A launched engine runs in its own process group (`start_new_session=True`), so that stopping it
stops everything it spawned (vLLM's engine core, SGLang's scheduler/detokenizer processes) and
nothing else: signals go to that group id, never to a process found by name.

The API key of an attached target lives only in a `Secret` (kvprobe.observe.http) and in request
headers built on demand; `repr`, `str`, facts, logs and exceptions never contain it.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import weakref
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvprobe.engines import get_dialect  # ConfigError for an unknown engine
from kvprobe.engines.base import ReportedCapacity
from kvprobe.errors import TargetError
from kvprobe.observe.client import list_models
from kvprobe.observe.http import Secret, error_reason, http_get, read_key, redact_url
from kvprobe.observe.sampler import Sampler
from kvprobe.procgroup import free_port, group_members, port_in_use, stop_group
from kvprobe.targets.engine import emulator_argv, engine_argv
from kvprobe.targets.facts import EngineFacts, merge_reports
from kvprobe.targets.interface import OneEngine, OpenHow

__all__ = ["Target"]

DEFAULT_HEALTH_PATH = "/health"
LOG_TAIL_LINES = 40
_MAX_LOG_READ = 4 * 2**20  # bytes of the start-up log handed to the dialect's parser
_TAIL_LINE_CHARS = 400
BIND_FAILURE = "error while attempting to bind on address"  # asyncio's create_server, a port it cannot bind


def _emergency_stop(proc: subprocess.Popen, pgid: int) -> None:
    """Finalizer/atexit path: the interpreter is going away and the Target was never stopped."""
    if proc.returncode is None or group_members(pgid, proc):
        stop_group(proc, pgid, grace=2.0)


# --------------------------------------------------------------------------- dialects


def _health_path(dialect) -> str:
    return getattr(dialect, "HEALTH_PATH", DEFAULT_HEALTH_PATH)


def _alive_path(dialect) -> str:
    return getattr(dialect, "ALIVE_PATH", None) or _health_path(dialect)


# --------------------------------------------------------------------------- Target


class Target(OneEngine):
    """A launched or attached engine. Use as a context manager: leaving it always stops a launch."""

    def __init__(self, *, engine: str, url: str, mode: str, dialect=None, log_path: str | None = None,
                 proc: subprocess.Popen | None = None, api_key: Secret | None = None,
                 api_key_env: str | None = None):
        self.engine = engine
        self.url = url.rstrip("/")
        self.mode = mode
        self.log_path = log_path
        self.api_key_env = api_key_env
        self._dialect = dialect
        self._proc = proc
        self._pgid = proc.pid if proc is not None else None
        self._api_key = api_key
        self._facts: EngineFacts | None = None
        self._stopped = False
        self._stop_lock = threading.Lock()
        self.stop_report: dict[str, object] = {}  # how the last stop went (signal used, survivors)
        self._finalizer = None
        if proc is not None:
            # Runs when the Target is garbage-collected unstopped, and at interpreter exit
            # (weakref.finalize's atexit hook), so a forgotten stop() never leaves the group running.
            self._finalizer = weakref.finalize(self, _emergency_stop, proc, proc.pid)

    # ------------------------------------------------------------------ construction

    @classmethod
    def launch(cls, argv: list[str], *, engine: str, port: int | None = None, log_path: str,
               startup_timeout: float, env: dict[str, str] | None = None, host: str = "127.0.0.1",
               api_key_env: str | None = None) -> Target:
        """Start `argv` in its own process group and wait until HEALTH_PATH answers 200.

        `port=None` picks a free port and substitutes it for "{port}" in argv. Raises TargetError
        (with the log tail, and with the group already stopped) when the binary is missing, the
        port is taken, the process exits during start-up, or it is not healthy by the deadline.
        """
        dialect = get_dialect(engine)
        if port is None:
            port = free_port(host)
        argv = [str(a).replace("{port}", str(port)) for a in argv]
        if port_in_use(host, port):
            raise TargetError(f"cannot launch {engine}: port {port} on {host} is already in use")
        log = Path(log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        api_key = read_key(api_key_env, child_env) if api_key_env else None
        with open(log, "wb") as log_file:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                        env=child_env, start_new_session=True, close_fds=True)
            except FileNotFoundError:
                raise TargetError(f"cannot launch {engine}: executable {argv[0]!r} not found") from None
            except PermissionError:
                raise TargetError(f"cannot launch {engine}: executable {argv[0]!r} is not executable") from None
        target = cls(engine=engine, url=f"http://{host}:{port}", mode="launch", dialect=dialect,
                     log_path=str(log), proc=proc, api_key=api_key, api_key_env=api_key_env)
        try:
            target._wait_healthy(startup_timeout)
        except BaseException:
            target.stop(grace=3.0)  # a failed start must not leave the group behind
            raise
        return target

    @classmethod
    def open(cls, exp, how: OpenHow) -> Target:
        """The engine an expectation names: attached at a URL (the caller's, else `target.url`), or
        the emulator or the real engine launched on `target.port` (else a free one)."""
        url = how.url or exp.target.url
        if url:
            return cls.attach(url, engine=exp.engine, api_key_env=exp.target.api_key_env)
        dialect = get_dialect(exp.engine)
        port = exp.target.port or free_port()
        if exp.target.mode == "emulator":
            argv = emulator_argv(exp, dialect, port=port)
        else:
            argv = engine_argv(exp, dialect, port=port, command=how.engine_command)
        return cls.launch(argv, engine=exp.engine, port=port, log_path=str(how.artifacts / "engine.log"),
                          startup_timeout=exp.target.startup_timeout, env=exp.target.env or None)

    @classmethod
    def attach(cls, url: str, *, engine: str, api_key_env: str | None, timeout: float = 10.0) -> Target:
        """Reach an engine at `url`; the API key is read from the environment variable `api_key_env`."""
        dialect = get_dialect(engine)
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise TargetError(f"cannot attach to {redact_url(url)!r}: expected http(s)://host:port")
        api_key = read_key(api_key_env, os.environ) if api_key_env else None
        target = cls(engine=engine, url=url, mode="attach", dialect=dialect, api_key=api_key,
                     api_key_env=api_key_env)
        target._wait_healthy(timeout)
        return target

    # ------------------------------------------------------------------ state

    @property
    def headers(self) -> dict[str, str]:
        """Request headers (Authorization when an API key is configured). Never print these."""
        if self._api_key is None:
            return {}
        return {"Authorization": f"Bearer {self._api_key.reveal()}"}

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def pgid(self) -> int | None:
        return self._pgid

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    @property
    def dialect(self):
        """The engine's dialect module, resolved once when the target was made."""
        return self._dialect

    @property
    def health_path(self) -> str:
        return _health_path(self._dialect)

    def __repr__(self) -> str:
        key = f", api_key_env={self.api_key_env!r}" if self.api_key_env else ""
        proc = f", pid={self.pid}" if self._proc is not None else ""
        return f"Target({self.engine!r}, {redact_url(self.url)!r}, mode={self.mode!r}{proc}{key})"

    __str__ = __repr__

    def alive(self) -> bool:
        """Launched: the process has not exited. Attached: the dialect's ALIVE_PATH (else the health
        path) answers 200 within 2 s."""
        if self._stopped:
            return False
        if self._proc is not None:
            return self._proc.poll() is None
        return self._health_status(timeout=2.0, path=_alive_path(self._dialect))[0] == 200

    def ensure_alive(self) -> None:
        """Raise TargetError (exit code and log tail) when the engine has gone away."""
        if self.alive():
            return
        if self._proc is not None:
            raise TargetError(f"{self.engine} at {redact_url(self.url)} exited with code {self._proc.returncode}",
                              log_tail=self.log_tail())
        raise TargetError(f"{self.engine} at {redact_url(self.url)} is not healthy ({self.health_path})")

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        """The last `n` lines of the engine log ("" when attached or nothing was written)."""
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                fh.seek(max(0, size - 256 * n - 4096))
                data = fh.read()
        except OSError:
            return ""
        lines = data.decode("utf-8", "replace").splitlines()[-n:]
        return "\n".join(line[:_TAIL_LINE_CHARS] for line in lines)

    def startup_refusal(self) -> str | None:
        """The engine's own line saying why it would not start (an unknown flag, a pool too small),
        read from its log by the dialect; None when there is no such line."""
        if not self.log_path or self._dialect is None:
            return None
        try:
            with open(self.log_path, "rb") as fh:
                text = fh.read(_MAX_LOG_READ).decode("utf-8", "replace")
        except OSError:
            return None
        line = self._dialect.startup_refusal_line(text)
        return line[:_TAIL_LINE_CHARS] if line else None

    # ------------------------------------------------------------------ health

    def _health_status(self, timeout: float, path: str | None = None) -> tuple[int | None, str]:
        try:
            status, _ = http_get(self.url + (path or self.health_path), headers=self.headers, timeout=timeout)
            return status, f"HTTP {status}"
        except (OSError, urllib.error.URLError, ValueError) as err:
            return None, error_reason(err)

    def _wait_healthy(self, timeout: float) -> None:
        start = time.monotonic()
        deadline = start + timeout
        delay = 0.05
        last = "no answer yet"
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                refusal = self.startup_refusal()
                raise TargetError(
                    f"{self.engine} exited with code {self._proc.returncode} during start-up "
                    f"(after {time.monotonic() - start:.1f} s, log {self.log_path})"
                    + (f": the engine refused: {refusal}" if refusal else ""),
                    log_tail=self.log_tail())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                where = f", log {self.log_path}" if self.log_path else ""
                raise TargetError(
                    f"{self.engine} at {redact_url(self.url)} not healthy within {timeout:g} s "
                    f"(GET {self.health_path}: {last}{where})", log_tail=self.log_tail())
            if (taken := self._bind_failure()) is not None:
                raise TargetError(
                    f"{self.engine} could not serve on {redact_url(self.url)}: another process took the port while it "
                    f"started ({taken}; log {self.log_path})", log_tail=self.log_tail())
            status, last = self._health_status(timeout=min(2.0, max(remaining, 0.05)))
            if status == 200:
                # Someone else may have answered on our port while our process died binding it.
                if self._proc is not None and self._proc.poll() is not None:
                    continue
                return
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, 0.5)

    def _bind_failure(self) -> str | None:
        """The server's own line that it could not bind its port (uvicorn logs asyncio's error and waits:
        SGLang 0.5.23 lived on while a store on the port answered no health check, to the deadline)."""
        port = urllib.parse.urlsplit(self.url).port
        return None if self._proc is None else next(
            (ln.strip() for ln in self.log_tail().splitlines() if BIND_FAILURE in ln and f", {port})" in ln), None)

    # ------------------------------------------------------------------ facts

    def facts(self, *, refresh: bool = False, timeout: float = 5.0) -> EngineFacts:
        """Capacity and limits the engine reports: /metrics, then info endpoints, then the start-up log.

        Earlier sources win a field; `reported.sources` says where each field came from and
        `conflicts` lists fields on which the sources disagree.
        """
        if self._facts is not None and not refresh:
            return self._facts
        reports: list[tuple[str, ReportedCapacity]] = []
        errors: list[str] = []
        d = self._dialect
        if d is None:
            errors.append(f"no dialect for {self.engine!r}: kvprobe.engines.get_dialect is not available")
        else:
            self._facts_from_metrics(d, timeout, reports, errors)
            for path in getattr(d, "INFO_PATHS", ()):
                self._facts_from_info(d, path, timeout, reports, errors)
            for path in getattr(d, "OPTIONAL_INFO_PATHS", ()):
                self._facts_from_info(d, path, timeout, reports, errors, optional=True)
            if self.log_path and hasattr(d, "parse_startup_log"):
                try:
                    with open(self.log_path, "rb") as fh:
                        text = fh.read(_MAX_LOG_READ).decode("utf-8", "replace")
                    reports.append((f"log:{self.log_path}", d.parse_startup_log(text)))
                except OSError as err:
                    errors.append(f"start-up log {self.log_path}: {err}")
        reported, conflicts = merge_reports(reports)
        self._facts = EngineFacts(engine=self.engine, version=reported.version, url=redact_url(self.url),
                                  reported=reported, log_path=self.log_path, mode=self.mode,
                                  conflicts=conflicts, errors=errors)
        return self._facts

    def _get(self, path: str, timeout: float) -> bytes:
        status, body = http_get(self.url + path, headers=self.headers, timeout=timeout)
        if status != 200:
            raise ValueError(f"HTTP {status}")
        return body

    def _facts_from_metrics(self, d, timeout, reports, errors) -> None:
        if not hasattr(d, "reported_from_metrics"):
            return
        try:
            text = self._get("/metrics", timeout).decode("utf-8", "replace")
            families = {fam.name: fam for fam in text_string_to_metric_families(text)}
        except (OSError, urllib.error.URLError, ValueError) as err:
            errors.append(f"GET /metrics: {error_reason(err)}")
            return
        reports.append(("metrics", d.reported_from_metrics(families)))

    def _facts_from_info(self, d, path, timeout, reports, errors, *, optional: bool = False) -> None:
        try:
            if path == getattr(d, "MODELS_PATH", None):  # the served model, through the openai client
                status, body = list_models(self.url, prefix=path[:-len("/models")], headers=self.headers,
                                           timeout=timeout)
            else:
                status, raw = http_get(self.url + path, headers=self.headers, timeout=timeout)
            if optional and status == 404:
                return  # this deployment does not serve it (e.g. vLLM without VLLM_SERVER_DEV_MODE)
            if status != 200:
                raise ValueError(f"HTTP {status}")
            if path != getattr(d, "MODELS_PATH", None):
                body = json.loads(raw)
        except (OSError, urllib.error.URLError, ValueError) as err:
            errors.append(f"GET {path}: {error_reason(err)}")
            return
        if isinstance(body, dict):
            reports.append((f"GET {path}", d.reported_from_info(path, body)))
        else:
            errors.append(f"GET {path}: expected a JSON object, got {type(body).__name__}")

    def sampler(self, *, interval: float) -> Sampler:
        """The engine's /metrics, read every `interval` seconds once started."""
        return Sampler(self.url, self._dialect.METRICS, interval=interval, headers=self.headers)

    # ------------------------------------------------------------------ stop

    def close(self) -> None:
        self.stop()

    def stop(self, grace: float = 10) -> int | None:
        """SIGTERM the group, SIGKILL it after `grace` s, reap, verify nothing of it is left.

        Returns the leader's exit code (None when attached). Idempotent. Raises TargetError only
        if processes of the group survive SIGKILL (which needs an uninterruptible sleep).
        """
        with self._stop_lock:
            if self._proc is None:
                self._stopped = True
                return None
            if self._stopped:
                return self._proc.returncode
            t0 = time.monotonic()
            killed, survivors = stop_group(self._proc, self._pgid, grace)
            self._stopped = True
            self.stop_report = {"sigkill": killed, "survivors": survivors,
                                "seconds": round(time.monotonic() - t0, 3), "returncode": self._proc.returncode}
            if self._finalizer is not None:
                self._finalizer.detach()
            if survivors:
                raise TargetError(f"{self.engine}: processes {survivors} of group {self._pgid} survived SIGKILL")
            return self._proc.returncode

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


