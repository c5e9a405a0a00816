"""sglang-router 0.3.2: its facts, its environment, and the launcher of its process.

The router is the real one: the `sglang-router` wheel (a Rust extension, `sglang_router_rs`,
with a Python console script), installed into an environment kvprobe makes under
`~/.cache/kvprobe/envs/` like the engine environments (`kvprobe.targets.shadow.envs`; never inside a
repository, never into kvprobe's own environment). Its dependencies are light (aiohttp, fastapi,
uvicorn, orjson, setproctitle): about 30 MB, a few seconds from a warm pip cache.

Facts below were read from the 0.3.2 wheel (`sglang_router/router_args.py`, `cli.py`) and
measured against it with kvprobe's emulator (tests/fleet/test_router.py keeps them true):

- `sglang-router launch --worker-urls URL... --policy P --host H --port N` starts the HTTP router
  (cli.py: subcommands `launch` and `server`; without one it prints usage and exits).
- Policies (router_args.py `--policy` choices): random, round_robin, cache_aware (the default),
  power_of_two, manual. PD-only: bucket.
- Workers are registered in the background: the router logs "Router ready | workers: []" and
  answers /health before any worker is added. `GET /readiness` answers
  `{"status": "ready", "healthy_workers": k, "total_workers": n}`: ready means k == replicas.
  `GET /workers` lists each worker with `load`, the router's own count of its requests in flight
  (what power_of_two and cache_aware compare).
- Registering a worker, the router first tries gRPC (an HTTP/2 preface the emulator's aiohttp
  logs as a BadHttpMessage, harmless), then asks `/server_info` -> `/get_server_info` and
  `/model_info` -> `/get_model_info`; a 404 on all of them is tolerated (model id "unknown").
  Health checks GET `/health` (`--health-check-endpoint`) every 60 s. So it forwards to a
  vLLM-dialect OpenAI server (our emulator, `vllm serve`) as well as to SGLang's.
- `/v1/completions` is forwarded with the body's extra fields intact (ignore_eos, min_tokens,
  stream_options reach the worker), but the router parses `prompt` first as a string or a list
  of strings: a token-id list is refused with HTTP 422 ("prompt: data did not match any variant
  of untagged enum StringOrArray"). A probe through the router therefore sends prompts as text
  (PROMPT_FORMAT); the emulator reads one whitespace-separated word as one token, so P words are
  exactly P tokens. A real engine's tokenizer does not: exact lengths behind this router need an
  engine whose tokenizer maps the words one to one (not provided here).
- Prometheus: `--prometheus-host/--prometheus-port` (default 0.0.0.0:29000): `smg_*` families,
  e.g. `smg_worker_selection_total{policy=...}`, `smg_router_requests_total`.
- Retries (5 by default) and the circuit breaker would resend or withhold requests behind the
  load generator's back: kvprobe launches with `--disable-retries --disable-circuit-breaker`, so
  an engine's error reaches the client as the engine sent it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import weakref
from pathlib import Path

from kvprobe.errors import KvprobeError
from kvprobe.observe.http import http_get
from kvprobe.procgroup import free_port, port_in_use, stop_group
from kvprobe.targets.shadow import envs
from kvprobe.targets.shadow.router_env import NAME, VERSION

POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")  # router_args.py choices kvprobe models
PROMPT_FORMAT = "text"  # token-id prompts are refused with 422 (module doc)
READINESS_PATH = "/readiness"
WORKERS_PATH = "/workers"
STARTUP_TIMEOUT = 60.0


class RouterError(KvprobeError):
    """The router did not start, or is not routing to every replica."""

    exit_code = 3


def command(binary: str | Path, worker_urls: list[str], *, policy: str, port: int, metrics_port: int,
            host: str = "127.0.0.1") -> list[str]:
    return [str(binary), "launch", "--worker-urls", *worker_urls, "--policy", policy,
            "--host", host, "--port", str(port), "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            "--disable-retries", "--disable-circuit-breaker", "--log-level", "warn"]


def _get_json(url: str, timeout: float = 2.0) -> tuple[int, object]:
    status, body = http_get(url, timeout=timeout)
    try:
        return status, json.loads(body.decode("utf-8", "replace") or "null")
    except ValueError:
        return status, None


def readiness(url: str) -> tuple[bool, str]:
    """(ready, why): ready once every worker the router was given is healthy."""
    try:
        status, body = _get_json(url.rstrip("/") + READINESS_PATH)
    except OSError as err:
        return False, f"no answer ({type(err).__name__}: {err})"
    if status != 200 or not isinstance(body, dict):
        return False, f"{READINESS_PATH}: HTTP {status} {str(body)[:120]}"
    healthy, total = body.get("healthy_workers"), body.get("total_workers")
    return (bool(total) and healthy == total), f"{healthy}/{total} workers healthy"


def worker_loads(url: str) -> dict[str, int]:
    """The router's in-flight count per worker URL (`GET /workers`)."""
    status, body = _get_json(url.rstrip("/") + WORKERS_PATH)
    if status != 200 or not isinstance(body, dict):
        raise RouterError(f"{WORKERS_PATH}: HTTP {status}")
    return {w["url"]: int(w.get("load", 0)) for w in body.get("workers", [])}


class RouterProcess:
    """The router in its own process group; `stop()` (or leaving the `with`) ends the group."""

    def __init__(self, proc: subprocess.Popen, *, url: str, metrics_url: str, log_path: str, policy: str,
                 worker_urls: list[str]):
        self._proc = proc
        self.pgid = proc.pid
        self.url = url
        self.metrics_url = metrics_url
        self.log_path = log_path
        self.policy = policy
        self.worker_urls = list(worker_urls)
        self._stopped = False
        self._finalizer = weakref.finalize(self, _emergency_stop, proc)

    @classmethod
    def launch(cls, worker_urls: list[str], *, policy: str, log_path: str | Path, binary: str | Path | None = None,
               startup_timeout: float = STARTUP_TIMEOUT, host: str = "127.0.0.1") -> RouterProcess:
        if policy not in POLICIES:
            raise RouterError(f"router policy {policy!r}: kvprobe drives {', '.join(POLICIES)}")
        if binary is None:
            binary = envs.require(NAME, VERSION).bin("sglang-router")
        port, metrics_port = free_port(host), free_port(host)
        while metrics_port == port:
            metrics_port = free_port(host)
        if port_in_use(host, port):
            raise RouterError(f"cannot launch {NAME}: port {port} on {host} is already in use")
        argv = command(binary, worker_urls, policy=policy, port=port, metrics_port=metrics_port, host=host)
        log = Path(log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as fh:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                        start_new_session=True, close_fds=True,
                                        env={**os.environ, "NO_COLOR": "1", "RUST_LOG_STYLE": "never"})
            except FileNotFoundError:
                raise RouterError(f"cannot launch {NAME}: {argv[0]!r} not found") from None
        router = cls(proc, url=f"http://{host}:{port}", metrics_url=f"http://{host}:{metrics_port}/metrics",
                     log_path=str(log), policy=policy, worker_urls=worker_urls)
        try:
            router.wait_ready(startup_timeout)
        except BaseException:
            router.stop(grace=3.0)
            raise
        return router

    def wait_ready(self, timeout: float) -> None:
        """Until /readiness counts every worker healthy; RouterError with the log tail otherwise."""
        deadline = time.monotonic() + timeout
        why, delay = "no answer yet", 0.05
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RouterError(f"{NAME} exited with code {self._proc.returncode} while starting:\n{self.log_tail()}")
            ready, why = readiness(self.url)
            if ready and len(worker_loads(self.url)) == len(self.worker_urls):
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        raise RouterError(f"{NAME} at {self.url} not routing to all {len(self.worker_urls)} workers within "
                          f"{timeout:.0f} s ({why}):\n{self.log_tail()}")

    def alive(self) -> bool:
        return not self._stopped and self._proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = Path(self.log_path).read_text("utf-8", "replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def stop(self, grace: float = 5.0) -> int | None:
        if self._stopped:
            return self._proc.returncode
        self._stopped = True
        _, survivors = stop_group(self._proc, self.pgid, grace)
        self._finalizer.detach()
        if survivors:
            raise RouterError(f"{NAME}: processes {survivors} of group {self.pgid} survived SIGKILL")
        return self._proc.returncode

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _emergency_stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        stop_group(proc, proc.pid, 2.0)
