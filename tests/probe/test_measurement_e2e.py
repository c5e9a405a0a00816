"""The measurement end to end through the emulator: a request cap named as a request cap, a probe
that cannot measure reported as an error with only the artifacts it wrote, an absent counter shown
as absent."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvprobe.probe.run import ProbeOptions, run_probe
from kvprobe.procgroup import free_port
from kvprobe.targets.launch import Target

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def probe(exp, tmp_path, **options):
    lines: list[str] = []
    result = run_probe(exp, ProbeOptions(artifacts_dir=tmp_path / "art", log=lines.append, **options))
    return result, lines


def assert_cap_named(result, flag, *words):
    assert result.error is None
    assert result.diagnosis.limit == flag.replace("-", "_") and result.diagnosis.flag == flag
    rp = result.check("rejection_point")
    assert not rp.passed and not rp.inconclusive, rp.reason
    for word in words:
        assert word in rp.reason, rp.reason
    assert "smaller than reported" not in rp.reason
    gap = result.check("usage_gap")
    assert not gap.passed and "misreports" not in gap.reason and "KV did not stop admission" in gap.reason
    assert result.status == "failed"


def test_a_request_cap_attached_is_named_with_the_expectations_value(expectation, tmp_path, groups):
    """vLLM started with --max-num-seqs 16, probed with an expectation that says 256."""
    port = free_port()
    argv = [sys.executable, "-m", "kvprobe", "emulate", "vllm", "--model", "meta-llama/Llama-3.1-8B",
            "--port", str(port), "--num-gpu-blocks-override",
            "201", "--max-model-len", "2048", "--max-num-seqs", "16"]
    with Target.launch(argv, engine="vllm", port=port, log_path=str(tmp_path / "engine.log"),
                       startup_timeout=30) as target:
        exp = replace(expectation("emulated-vllm.yaml"), checks=("rejection_point", "usage_gap", "no_preemption"))
        result, _ = probe(exp, tmp_path, url=target.url)
    assert_cap_named(result, "max-num-seqs", "a request cap binds at 16", "the expectation says max_num_seqs=256")
    # a finished request's slot waits a step for the next one: at O=32 the cap of 16 reads ~15.5
    assert 16 * (1 - 2 / 33) <= result.rejection.rejection_point <= 16.0
    assert "requests waited from N=" in result.check("no_preemption").reason
    report = Path(result.artifacts["report"]).read_text()
    assert "measured limit: a request cap binds at 16" in report


def test_a_request_cap_the_engine_logs_names_the_flag_that_differs(expectation, tmp_path, groups):
    """Launched: vLLM's start-up log lists its non-default args (not published anywhere the ledger
    reads); the engine gets the cap, the ledger the expectation's flags."""
    exp = expectation("emulated-vllm.yaml")
    exp = replace(exp, checks=("rejection_point", "usage_gap"),
                  target=replace(exp.target, emulator={**exp.target.emulator, "args": ["--max-num-seqs", "16"]}))
    result, _ = probe(exp, tmp_path)
    assert_cap_named(result, "max-num-seqs", "a request cap binds at 16",
                     "the engine reports max_num_seqs=16, the expectation says 256")
    assert result.diagnosis.reported == 16
    groups.assert_none_left()


def test_a_request_cap_sglang_publishes_is_predicted_and_binds_as_predicted(expectation, tmp_path, groups):
    """SGLang publishes max_running_requests in /server_info: discovery says so before the
    ramp and the ledger predicts from it; the signature the levels leave confirms the cap."""
    exp = expectation("emulated-sglang.yaml")
    exp = replace(exp, checks=("rejection_point",),
                  target=replace(exp.target, emulator={**exp.target.emulator,
                                                       "args": ["--max-running-requests", "12"]}))
    result, lines = probe(exp, tmp_path)
    assert result.error is None
    assert any("from what the engine publishes: admission limit 12 (max_running_requests binds)" in line
               for line in lines), lines[:4]
    rp = result.check("rejection_point")
    assert rp.predicted == 12 and rp.binding == "max_running_requests"
    assert rp.passed or "load generator" in rp.reason, rp.reason
    assert result.diagnosis.limit == "max_running_requests" and "binds as predicted" in result.diagnosis.reason
    groups.assert_none_left()


def test_sglang_shows_an_absent_retraction_counter_as_absent(expectation, tmp_path, groups):
    """SGLang creates sglang:num_retracted_requests_total at its first retraction; reserving each
    request in full at admission it never retracts here, so the counter never appears (§6)."""
    exp = replace(expectation("emulated-sglang.yaml"), checks=("rejection_point",))
    result, lines = probe(exp, tmp_path)
    assert result.error is None and result.levels
    assert all(lv.preemptions is None for lv in result.levels)
    assert all(lv.running_source == "client" and lv.engine_running_mean is not None for lv in result.levels)
    assert any("preemptions —" in line and "(engine gauge, sampled)" in line for line in lines)
    doc = json.loads(Path(result.artifacts["result"]).read_text())
    assert all(level["preemptions"] is None for level in doc["levels"])
    assert "preemption counter absent" in result.diagnosis.reason
    rp = result.check("rejection_point")
    assert rp.passed, rp.reason
    groups.assert_none_left()


def test_an_unreachable_engine_is_an_error_with_exit_code_3(tmp_path):
    """Finding 5: exit 3 (could not measure), verdict ERROR, and a closing line with only what exists."""
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "kvprobe", "probe", str(REPO / "expectations" / "emulated-vllm.yaml"),
                           "--url", url, "--artifacts", str(tmp_path / "art")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "verdict: ERROR — vllm at " in proc.stdout and "not healthy" in proc.stdout
    closing = [line for line in proc.stdout.splitlines() if line.startswith("artifacts:")][-1]
    assert "result.json" in closing and "ramp.png" not in closing and "metrics.jsonl" not in closing
    for name in closing.split("(")[1].rstrip(")").split(", "):
        assert (tmp_path / "art" / name).is_file(), name
    doc = json.loads((tmp_path / "art" / "result.json").read_text())
    assert doc["verdict"]["status"] == "error"


def test_the_token_budget_is_named_when_it_binds(expectation, tmp_path, groups):
    """vLLM given a 64-token step budget (and a cap of 64, as vLLM requires): at P=128, O=32 each
    step can prefill and decode for about 64 x 32 / 160 = 12.8 running requests, KV stays free."""
    exp = expectation("emulated-vllm.yaml")
    exp = replace(exp, checks=("rejection_point", "usage_gap"),
                  target=replace(exp.target, emulator={
                      **exp.target.emulator,
                      "args": ["--max-num-batched-tokens", "64", "--max-num-seqs", "64"]}))
    result, _ = probe(exp, tmp_path)
    assert result.error is None and result.diagnosis.limit == "token_budget", result.diagnosis
    rp = result.check("rejection_point")
    assert not rp.passed and not rp.inconclusive
    for words in ("max_num_batched_tokens=64 holds 12.8 running",
                  "the engine reports max_num_batched_tokens=64, the expectation says 2048"):
        assert words in rp.reason, rp.reason
    assert "request cap" not in rp.reason and "smaller than reported" not in rp.reason
    groups.assert_none_left()
