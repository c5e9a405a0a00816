"""The SGLang shadow against the real SGLang 0.5.23: its engine environment (installed when missing,
never skipped), shadow servers shared by the checks that use the same flags, and the figures each
check measured, printed at the end of the run."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvprobe.engines import sglang as dialect
from kvprobe.procgroup import free_port, group_members
from kvprobe.spec.expectation import load_expectations
from kvprobe.targets.shadow import envs, launch
from kvprobe.targets.shadow.target import ShadowTarget, launch_request
from tests.conftest import add_figure

REPO = Path(__file__).resolve().parents[2]
EXPECTATIONS = REPO / "expectations" / "shadow-sglang.yaml"
ENGINE, VERSION = "sglang", "0.5.23"
STARTUP_TIMEOUT = 300.0  # SGLang starts in 20-60 s here; more on a busy machine


@pytest.fixture
def figures(request):
    """`figures(line)`: printed now (visible with -s) and in the run's terminal summary, which
    collects them from every worker (tests/conftest.py)."""
    def add(line: str) -> None:
        print(line, flush=True)
        add_figure(request.node, line)
    return add


@pytest.fixture(scope="session")
def sglang_env():
    """The engine environment, installed first when it is missing (2-4 min cold). The cache folder is
    pinned for the session: pytester moves HOME, and with it the default ~/.cache/kvprobe."""
    mp = pytest.MonkeyPatch()
    mp.setenv(envs.CACHE_ENV, str(envs.cache_root()))
    yield envs.ensure(ENGINE, VERSION, log=lambda line: print(line, flush=True))
    mp.undo()


def shipped(name: str):
    """An expectation of expectations/shadow-sglang.yaml, by name."""
    found = {e.name: e for e in load_expectations(EXPECTATIONS)}
    return found[name]


class Server:
    """A running shadow server: where it is, its process group, its log, what it reports."""

    def __init__(self, exp, *, url: str, pgid: int, log_path: str, target: ShadowTarget | None = None):
        self.exp, self.url, self.pgid, self.log_path, self.target = exp, url, pgid, log_path, target

    def metrics(self) -> dict:
        """{family name: [samples]} from /metrics, parsed by prometheus_client."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    def gauge(self, role: str) -> float | None:
        name = getattr(dialect.METRICS, role, None) or dialect.METRICS.extra[role]
        samples = self.metrics().get(name) or []
        return samples[0].value if samples else None

    def server_info(self) -> dict:
        with urllib.request.urlopen(self.url + "/server_info", timeout=10) as resp:
            return json.loads(resp.read())

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")


def start_server(exp, log_path: Path, *, startup_timeout: float = STARTUP_TIMEOUT) -> Server:
    """The launch of `target: {launch: shadow}` (kvprobe.targets.shadow.target.open_shadow's steps), owned by
    the test so several checks can share it."""
    req = launch_request(exp, port=free_port())
    argv, environ = launch.command(req)
    target = ShadowTarget.launch(argv, engine=exp.engine, port=req.port, log_path=str(log_path),
                                 startup_timeout=startup_timeout, env=environ)
    return Server(exp, url=target.url, pgid=target.pgid, log_path=str(log_path), target=target)


def stop_server(server: Server) -> None:
    """Stop the group; every process SGLang started (launcher, scheduler, detokenizer, resource
    tracker) was in it and is gone, checked by the group id."""
    pgid = server.pgid
    members_before = group_members(pgid)
    scratch = Path(server.target.scratch)
    # SGLang's sockets are named after files it never deletes (srt/server_args.py PortArgs): in the
    # target's own TMPDIR, which goes with the stop (kvprobe.targets.shadow.target.ShadowTarget)
    assert [p for p in scratch.iterdir() if p.name.startswith("tmp")], f"no socket names in {scratch}"
    server.target.stop()
    assert not scratch.exists(), f"{scratch} outlived the server"
    deadline = time.monotonic() + 10
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(pgid) == [], f"processes of group {pgid} left: {group_members(pgid)}"
    assert len(members_before) >= 3, f"expected launcher, scheduler and detokenizer in group {pgid}: {members_before}"


@pytest.fixture(scope="module")
def shadow_server(sglang_env, tmp_path_factory):
    """`shadow_server(name)`: a server with that shipped expectation's flags and time model, started
    once per module and flags, stopped (and checked gone) when the module ends."""
    servers: dict[tuple, Server] = {}

    def get(name: str, **changes) -> Server:
        exp = replace(shipped(name), **changes)
        key = (tuple(sorted(exp.flags.items())), tuple(sorted(exp.target.time_model.items())),
               exp.hardware.gpu_memory_bytes)
        if key not in servers:
            log = tmp_path_factory.mktemp("sglang-shadow") / "engine.log"
            servers[key] = start_server(exp, log)
        return servers[key]

    yield get
    for server in servers.values():
        stop_server(server)
