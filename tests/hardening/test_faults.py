"""Faults: each probe ends within a bounded time, with the reason and the log tail, and leaves no
process group of ours behind (checked by group id: `os.killpg(pgid, 0)` raises ProcessLookupError).

Cases already covered end to end in tests/probe (a never-healthy `sleep`, die_after.py, no /metrics,
SIGTERM to the console) are not repeated; here are the missing ones, each with the group check.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvprobe.probe.run import ProbeOptions, run_probe
from tests.hardening.conftest import wait_group_gone

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def probe(exp, tmp_path, log=None):
    lines: list[str] = []

    def record(line: str) -> None:
        lines.append(line)
        if log is not None:
            log(line)

    start = time.monotonic()
    result = run_probe(exp, ProbeOptions(artifacts_dir=tmp_path / "art", log=record))
    return result, lines, time.monotonic() - start


def launched(exp, command, *, startup_timeout=20.0, port=None):
    return replace(exp, target=replace(exp.target, mode="launch", command=tuple(command),
                                       startup_timeout=startup_timeout, port=port))


def assert_failed_with_artifacts(result, *words):
    assert not result.passed and result.error, result
    for word in words:
        assert word in result.error, result.error
    doc = json.loads(Path(result.artifacts["result"]).read_text())
    assert doc["verdict"]["passed"] is False and doc["verdict"]["error"] == result.error
    assert Path(result.artifacts["requests"]).exists()


def test_engine_binary_does_not_exist(expectation, tmp_path, groups):
    exp = launched(expectation("emulated-vllm.yaml"), ["/nonexistent/bin/vllm", "serve"])
    result, _, seconds = probe(exp, tmp_path)
    assert seconds < 10
    assert_failed_with_artifacts(result, "'/nonexistent/bin/vllm' not found")
    assert groups.targets == [] and groups.runs == []  # nothing was started, so nothing can be left


def test_engine_exits_during_start_with_its_real_error_in_the_log_tail(expectation, tmp_path, groups):
    """The vLLM emulator refuses a pool that cannot hold one max-model-len request, as vLLM does."""
    exp = expectation("emulated-vllm.yaml")
    # The ledger sees the file's max-model-len 2048; the engine gets 100000 appended (last one wins).
    exp = replace(exp, target=replace(exp.target, startup_timeout=30,
                                      emulator={**exp.target.emulator, "args": ["--max-model-len", "100000"]}))
    result, _, seconds = probe(exp, tmp_path)
    assert seconds < 30
    assert_failed_with_artifacts(result, "exited with code 1 during start-up")
    assert "larger than the available KV cache memory" in result.log_tail
    assert "larger than the available KV cache memory" in Path(result.artifacts["report"]).read_text()
    assert json.loads(Path(result.artifacts["result"]).read_text())["verdict"]["log_tail"] == result.log_tail
    assert len(groups.engine_pgids) == 1 and groups.runs == []
    groups.assert_none_left()


def test_engine_answers_but_never_becomes_healthy(expectation, tmp_path, groups):
    exp = launched(expectation("emulated-vllm.yaml"), [sys.executable, str(HERE / "unhealthy_server.py")],
                   startup_timeout=3.0)
    result, _, seconds = probe(exp, tmp_path)
    assert seconds < 20
    assert_failed_with_artifacts(result, "not healthy within 3 s", "HTTP 503")
    assert "unhealthy_server: listening" in result.log_tail
    assert len(groups.engine_pgids) == 1
    groups.assert_none_left()


def test_port_taken(expectation, tmp_path, groups):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        exp = expectation("emulated-vllm.yaml")
        exp = replace(exp, target=replace(exp.target, port=port))
        result, _, seconds = probe(exp, tmp_path)
    assert seconds < 10
    assert_failed_with_artifacts(result, f"port {port}", "already in use")
    # the port is checked before anything is spawned: no engine and no Locust were ever started
    assert groups.runs == [] and groups.engine_pgids == []


def kill_group_at_first_level(pgids: callable):
    """A log callback that SIGKILLs a group once the first level's line is out (the ramp is running)."""
    state = {"killed": None}

    def on_line(line: str) -> None:
        if state["killed"] is None and line.lstrip().startswith("users"):
            state["killed"] = pgids()[0]
            os.killpg(state["killed"], signal.SIGKILL)

    return on_line, state


def test_engine_dies_mid_probe(expectation, tmp_path, groups):
    exp = expectation("emulated-sglang.yaml")
    on_line, state = kill_group_at_first_level(lambda: groups.engine_pgids)
    result, lines, seconds = probe(exp, tmp_path, log=on_line)
    assert state["killed"] is not None, lines
    assert seconds < 40
    assert_failed_with_artifacts(result, "died")
    assert "engine.log" in result.error and Path(result.artifacts["engine"]).stat().st_size > 0
    assert result.log_tail  # the emulator's last lines, next to the reason
    records = [json.loads(x) for x in Path(result.artifacts["requests"]).read_text().splitlines()]
    assert any(r["status"] == 200 for r in records)  # the first level's requests survive the crash
    assert len(groups.locust_pgids) == 1
    groups.assert_none_left()


def test_locust_dies_mid_ramp(expectation, tmp_path, groups):
    exp = expectation("emulated-vllm.yaml")
    on_line, state = kill_group_at_first_level(lambda: groups.locust_pgids)
    result, lines, seconds = probe(exp, tmp_path, log=on_line)
    assert state["killed"] is not None, lines
    assert seconds < 40
    assert_failed_with_artifacts(result, "Locust", "rc=-9")
    assert len(groups.engine_pgids) == 1
    for pgid in groups.engine_pgids + groups.locust_pgids:
        assert wait_group_gone(pgid, 0.1)
    groups.assert_none_left()


# --- /metrics that lies: garbage, gone halfway, or never there (HARDEN-EMU's emulator faults) --------


def short_ramp(exp):
    """Three levels (below, at and above the limit of ~20): enough for a plateau, fast enough for CI."""
    profile = replace(exp.profile, ramp=replace(exp.profile.ramp, levels=(10, 20, 28)), drain_seconds=2.0,
                      hold=replace(exp.profile.hold, seconds=2.0))
    return replace(exp, profile=profile)


@pytest.mark.parametrize("emulator_args, engine_sourced", [
    (["--fault", "metrics-garbage"], 0),           # 200 with an HTML page: the parser raises
    (["--fault", "metrics-drop-after=5"], 1),      # running/waiting/usage vanish during the ramp
    (["--disable-log-stats"], 0),                  # vLLM without engine statistics: no vllm:* families
], ids=["garbage", "drop-halfway", "disable-log-stats"])
def test_metrics_that_cannot_be_read_fall_back_to_the_streams(expectation, tmp_path, groups, emulator_args,
                                                              engine_sourced):
    exp = short_ramp(expectation("emulated-vllm.yaml"))
    exp = replace(exp, target=replace(exp.target, emulator={**exp.target.emulator, "args": emulator_args}))
    result, lines, seconds = probe(exp, tmp_path)
    assert seconds < 60
    assert result.error is None, (result.error, result.log_tail)
    sources = [lv.running_source for lv in result.levels]
    assert [lv.users for lv in result.levels] == [10, 20, 28]
    if engine_sourced:
        # When the families vanish depends on start-up time: some levels (possibly none) read the
        # engine, every later one the streams, and the last one certainly the streams.
        assert sources == sorted(sources, key=lambda src: src != "engine") and sources[-1] == "client", sources
    else:
        assert sources == ["client"] * 3, sources
    assert all(lv.running_mean == lv.running_mean for lv in result.levels)  # no NaN level enters the fit
    rp = result.check("rejection_point")
    # The streams estimate running to within ~2 (as tests/probe's no-/metrics case allows).
    seen = [(lv.users, round(lv.running_mean, 2), round(lv.waiting_mean, 2)) for lv in result.levels]
    assert rp.measured is not None and abs(rp.measured - rp.predicted) <= 2.0, (rp.reason, seen, result.client)
    # What only /metrics can show is never claimed: the drain is inconclusive, not a pass.
    leak = result.check("leak")
    assert leak.inconclusive and "metrics" in leak.reason, leak.reason
    assert not result.passed  # an inconclusive selected check is not a pass
    assert len(groups.engine_pgids) == 1 and len(groups.locust_pgids) == 1
    groups.assert_none_left()
