"""Target.launch / attach / stop against real processes in their own process groups."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from kvprobe.engines.base import ReportedCapacity
from kvprobe.errors import ConfigError, TargetError
from kvprobe.observe.http import http_get, redact_url
from kvprobe.procgroup import free_port, group_members
from kvprobe.targets.facts import merge_reports
from kvprobe.targets.launch import Target
from tests.engine_fixtures import FIXTURES

from .conftest import REPO, fake_argv, gone, wait_until

VLLM_METRICS = str(FIXTURES / "vllm-0.33.0-metrics.txt")
VLLM_LOG = str(FIXTURES / "vllm-0.33.0-startup.log")



def test_launch_ok_then_stop(tmp_path):
    log = tmp_path / "engine.log"
    t0 = time.monotonic()
    target = Target.launch(fake_argv("--delay", "0.3", "--metrics", VLLM_METRICS, "--log", VLLM_LOG),
                           engine="vllm", port=None, log_path=str(log), startup_timeout=20)
    try:
        assert time.monotonic() - t0 >= 0.3  # it waited for health, not just for the port
        assert target.alive()
        assert http_get(target.url + "/health")[0] == 200
        assert os.getpgid(target.pid) == target.pgid == target.pid  # its own group
        assert target.pgid != os.getpgrp()
        assert "listening on" in target.log_tail()
        assert "KV cache size" in log.read_text()
    finally:
        code = target.stop(grace=5)
    assert code == -15 and target.stop_report["sigkill"] is False
    assert not target.alive() and group_members(target.pgid) == [] and gone(target.pid)
    assert target.stop() == code  # idempotent


def test_facts_from_metrics_info_and_log(tmp_path):
    with Target.launch(fake_argv("--metrics", VLLM_METRICS, "--log", VLLM_LOG, "--max-model-len", "8192"),
                       engine="vllm", log_path=str(tmp_path / "e.log"), startup_timeout=20) as target:
        facts = target.facts()
    r = facts.reported
    assert (facts.engine, facts.mode, facts.url, facts.version) == ("vllm", "launch", target.url, "0.33.0")
    assert r.num_blocks == 3646 and r.block_size == 16  # vllm:cache_config_info
    assert r.max_model_len == 8192
    assert r.sources["num_blocks"] == "metrics" or r.sources["num_blocks"].startswith("metrics")
    assert all(r.sources.get(f) for f in ("num_blocks", "block_size", "max_model_len", "version"))
    assert facts.log_path == str(tmp_path / "e.log")


def test_merge_reports_order_sources_and_conflicts():
    metrics = ReportedCapacity(num_blocks=200, block_size=16, kv_tokens=3200)
    info = ReportedCapacity(max_model_len=8192, version="0.33.0", sources={"version": "GET /version"})
    log = ReportedCapacity(kv_tokens=3184, max_model_len=8192, max_concurrency=0.39)
    merged, conflicts = merge_reports([("metrics", metrics), ("info", info), ("log:x", log)])
    assert (merged.num_blocks, merged.kv_tokens, merged.max_concurrency) == (200, 3200, 0.39)
    assert merged.sources == {"num_blocks": "metrics", "block_size": "metrics", "kv_tokens": "metrics",
                              "max_model_len": "info", "version": "GET /version", "max_concurrency": "log:x"}
    assert conflicts == {"kv_tokens": {"metrics": 3200, "log:x": 3184}}


def test_missing_binary(tmp_path):
    with pytest.raises(TargetError, match="not found"):
        Target.launch(["/nonexistent/kvprobe-no-such-engine", "serve"], engine="vllm", port=free_port(),
                      log_path=str(tmp_path / "e.log"), startup_timeout=5)


def test_exit_during_start_is_reported_fast_with_exit_code_and_tail(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TargetError) as info:
        Target.launch(fake_argv("--mode", "exit", "--delay", "0.2"), engine="vllm", port=None,
                      log_path=str(tmp_path / "e.log"), startup_timeout=60)
    elapsed = time.monotonic() - t0
    assert elapsed < 15  # far below the 60 s deadline: it noticed the exit
    msg = str(info.value)
    assert "exited with code 3 during start-up" in msg.splitlines()[0]
    assert "No available memory for the cache blocks" in info.value.log_tail
    assert "No available memory" in msg  # the tail is part of what a person sees


def test_never_healthy_hits_the_deadline_and_leaves_nothing(tmp_path):
    pids = []
    t0 = time.monotonic()
    with pytest.raises(TargetError) as info:
        Target.launch(fake_argv("--mode", "never", "--pidfile", str(tmp_path / "unused")), engine="vllm",
                      port=None, log_path=str(tmp_path / "e.log"), startup_timeout=1.5)
    elapsed = time.monotonic() - t0
    assert 1.5 <= elapsed < 1.5 + 8
    first = str(info.value).splitlines()[0]
    assert "not healthy within 1.5 s" in first and "HTTP 503" in first
    assert "listening on" in info.value.log_tail
    pids = [int(w.split("=")[1].rstrip(",")) for w in info.value.log_tail.split() if w.startswith("pid=")]
    assert pids and all(gone(p) for p in pids)


def test_a_port_taken_while_the_engine_starts_ends_the_start_up_at_once(tmp_path):
    """The server's own bind error in its log ends the wait (a process that lingers after it, with a
    store answering no health check on the port, would otherwise run to the deadline)."""
    t0 = time.monotonic()
    with pytest.raises(TargetError) as info:
        Target.launch(fake_argv("--mode", "port-stolen"), engine="sglang", port=None,
                      log_path=str(tmp_path / "e.log"), startup_timeout=60)
    assert time.monotonic() - t0 < 60 / 4
    first = str(info.value).splitlines()[0]
    assert "another process took the port while it started" in first
    assert "error while attempting to bind on address" in first  # asyncio's own line, quoted
    pids = [int(w.split("=")[1].rstrip(",")) for w in info.value.log_tail.split() if w.startswith("pid=")]
    assert pids and all(gone(p) for p in pids)


def test_port_taken(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(TargetError, match=f"port {port} on 127.0.0.1 is already in use"):
            Target.launch(fake_argv(), engine="vllm", port=port, log_path=str(tmp_path / "e.log"),
                          startup_timeout=5)
    assert not (tmp_path / "e.log").exists()  # nothing was started


def test_sigterm_ignored_falls_back_to_sigkill(tmp_path):
    target = Target.launch(fake_argv("--mode", "ignore-term"), engine="vllm", port=None,
                           log_path=str(tmp_path / "e.log"), startup_timeout=20)
    t0 = time.monotonic()
    code = target.stop(grace=0.5)
    elapsed = time.monotonic() - t0
    assert code == -9 and target.stop_report["sigkill"] is True
    assert 0.5 <= elapsed < 0.5 + 5
    assert gone(target.pid) and group_members(target.pgid) == []


def test_whole_group_dies_including_a_grandchild(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    target = Target.launch(fake_argv("--mode", "grandchild", "--pidfile", str(pidfile)), engine="vllm",
                           port=None, log_path=str(tmp_path / "e.log"), startup_timeout=20)
    grandchild = int(pidfile.read_text())
    assert os.getpgid(grandchild) == target.pgid and not gone(grandchild)
    assert sorted(group_members(target.pgid)) == sorted([target.pid, grandchild])
    target.stop(grace=0.5)
    # the leader died of SIGTERM; the grandchild ignored it and needed the group SIGKILL
    assert target.returncode == -15 and target.stop_report["sigkill"] is True
    assert gone(grandchild) and group_members(target.pgid) == []


def test_context_manager_stops_on_error(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with Target.launch(fake_argv(), engine="vllm", log_path=str(tmp_path / "e.log"),
                           startup_timeout=20) as target:
            pid = target.pid
            raise RuntimeError("boom")
    assert gone(pid) and group_members(pid) == []


def test_ensure_alive_reports_a_death_mid_run(tmp_path):
    target = Target.launch(fake_argv(), engine="vllm", log_path=str(tmp_path / "e.log"), startup_timeout=20)
    try:
        os.kill(target.pid, 9)  # the engine crashes under load
        assert wait_until(lambda: not target.alive(), timeout=5)
        with pytest.raises(TargetError, match="exited with code -9") as info:
            target.ensure_alive()
        assert "listening on" in info.value.log_tail
    finally:
        target.stop(grace=1)


def test_interpreter_exit_never_leaves_the_group(tmp_path):
    """A script that launches and then just exits: the atexit hook must stop the engine."""
    pidfile = tmp_path / "leader.pid"
    script = textwrap.dedent(f"""
        import sys
        from kvprobe.targets.launch import Target
        t = Target.launch({fake_argv('--mode', 'ignore-term')!r}, engine="vllm", log_path={str(tmp_path / 'e.log')!r},
                          startup_timeout=20)
        open({str(pidfile)!r}, "w").write(str(t.pid))
        sys.exit(0)   # no stop(), no with-block
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=60, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    leader = int(pidfile.read_text())
    assert wait_until(lambda: gone(leader), timeout=10)
    assert group_members(leader) == []


# ------------------------------------------------------------------------------------- attach

SECRET = "sk-kvprobe-test-0123456789abcdef"


def test_attach_sends_the_key_and_never_shows_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPROBE_TEST_KEY", SECRET)
    engine = Target.launch(fake_argv("--require-key", SECRET, "--metrics", VLLM_METRICS), engine="vllm",
                           log_path=str(tmp_path / "e.log"), startup_timeout=20, api_key_env="KVPROBE_TEST_KEY")
    try:
        target = Target.attach(engine.url, engine="vllm", api_key_env="KVPROBE_TEST_KEY", timeout=5)
        assert target.alive()  # /health accepted the Authorization header (401 otherwise)
        assert target.headers == {"Authorization": f"Bearer {SECRET}"}
        facts = target.facts()
        shown = [repr(target), str(target), repr(facts), str(facts), *facts.errors, repr(target.__dict__),
                 target.log_tail(), repr(vars(facts.reported))]
        assert all(SECRET not in s for s in shown)
        assert facts.mode == "attach" and facts.log_path is None
        target.stop()  # attach: stops nothing
        assert engine.alive()
        # a wrong key is refused by the engine, and the refusal does not echo the key either
        monkeypatch.setenv("KVPROBE_WRONG_KEY", SECRET[::-1])
        with pytest.raises(TargetError) as info:
            Target.attach(engine.url, engine="vllm", api_key_env="KVPROBE_WRONG_KEY", timeout=0.5)
        assert "HTTP 401" in str(info.value)
        assert SECRET not in str(info.value) and SECRET[::-1] not in str(info.value)
    finally:
        engine.stop(grace=2)
    assert SECRET not in (tmp_path / "e.log").read_text()


def test_attach_unset_key_and_unreachable_url(monkeypatch):
    monkeypatch.delenv("KVPROBE_UNSET_KEY", raising=False)
    with pytest.raises(ConfigError, match="KVPROBE_UNSET_KEY"):  # bad input (exit 2), before any request
        Target.attach("http://127.0.0.1:9", engine="vllm", api_key_env="KVPROBE_UNSET_KEY")
    monkeypatch.setenv("KVPROBE_TEST_KEY", SECRET)
    t0 = time.monotonic()
    with pytest.raises(TargetError) as info:
        Target.attach(f"http://127.0.0.1:{free_port()}", engine="vllm", api_key_env="KVPROBE_TEST_KEY", timeout=1)
    assert time.monotonic() - t0 < 6
    assert "not healthy within 1 s" in str(info.value) and "Connection" in str(info.value)
    assert SECRET not in str(info.value) and SECRET not in repr(info.value)


def test_attach_rejects_a_url_that_is_not_http_and_redacts_credentials():
    with pytest.raises(TargetError, match="expected http"):
        Target.attach("localhost:8000", engine="vllm", api_key_env=None)
    with pytest.raises(TargetError) as info:
        Target.attach(f"http://admin:{SECRET}@127.0.0.1:{free_port()}", engine="vllm", api_key_env=None, timeout=0.3)
    assert SECRET not in str(info.value)
    assert redact_url(f"http://admin:{SECRET}@10.0.0.1:8000/v1") == "http://***@10.0.0.1:8000/v1"
    assert redact_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000"


def test_unknown_engine_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown engine"):
        Target.launch(fake_argv(), engine="tgi", log_path=str(tmp_path / "e.log"), startup_timeout=5)
    assert not (tmp_path / "e.log").exists()


def test_a_forgotten_target_is_stopped_when_collected(tmp_path):
    target = Target.launch(fake_argv(), engine="vllm", log_path=str(tmp_path / "e.log"), startup_timeout=20)
    pid = target.pid
    del target
    gc.collect()
    assert wait_until(lambda: gone(pid), timeout=10) and group_members(pid) == []
