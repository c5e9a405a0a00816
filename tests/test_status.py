"""Outcomes a CI can tell apart, and numbers that say what they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvprobe.analysis.levels import LevelStats
from kvprobe.cli.probe import exit_code
from kvprobe.probe.run import ProbeResult
from kvprobe.report.console import closing_line, levels_table, verdict_table, write_artifacts
from kvprobe.spec.expectation import load_expectations
from kvprobe.verdict.checks import CheckResult

REPO = Path(__file__).resolve().parents[1]
EXP = load_expectations(REPO / "expectations" / "emulated-vllm.yaml")[0]
FAULT = load_expectations(REPO / "expectations" / "faults" / "zombie-blocks.yaml")[0]


def check(name, *, passed=False, inconclusive=False):
    return CheckResult(name, passed=passed, inconclusive=inconclusive, reason=f"{name} reason")


@pytest.mark.parametrize("checks, error, status", [
    ([check("leak", passed=True), check("exactness", passed=True)], None, "passed"),
    ([check("leak", passed=True), check("exactness")], None, "failed"),
    ([check("leak", passed=True), check("rejection_point", inconclusive=True)], None, "error"),
    ([check("leak"), check("rejection_point", inconclusive=True)], None, "failed"),  # a disagreement wins
    ([], "cannot launch vllm: executable 'vllm' not found", "error"),
    ([check("leak", passed=True)], "the engine died during the probe", "error"),
    ([], None, "error"),  # nothing judged is never a pass
])
def test_status(checks, error, status):
    result = ProbeResult(expectation=EXP, checks=checks, error=error)
    assert result.status == status and result.passed is (status == "passed")


@pytest.mark.parametrize("target, status", [
    (check("leak"), "passed"),  # the fault's check fails: the fault expectation passes
    (check("leak", passed=True), "failed"),
    (check("leak", inconclusive=True), "error"),  # could not watch the drain: nothing proven
])
def test_status_of_a_fault_expectation(target, status):
    assert ProbeResult(expectation=FAULT, checks=[target]).status == status


def test_exit_codes():
    assert exit_code(["passed", "passed"]) == 0
    assert exit_code(["passed", "failed", "error"]) == 1
    assert exit_code(["passed", "error"]) == 3
    assert exit_code([]) == 3


def test_unreachable_engine_is_an_error_and_the_closing_line_names_only_what_was_written(tmp_path):
    result = ProbeResult(expectation=EXP, ledger=None, error="vllm at http://127.0.0.1:9 is not healthy (/health)")
    paths = write_artifacts(result, tmp_path, series=None, records=[], windows=[])
    (tmp_path / "ramp.png").write_bytes(b"stale")  # an earlier run's plot must not be listed ...
    line = closing_line(result, tmp_path)
    assert "ramp.png" not in line and "metrics.jsonl" not in line
    assert "result.json" in line and "requests.jsonl" in line and "report.txt" in line
    assert "plot" not in paths and "metrics" not in paths
    doc = json.loads((tmp_path / "result.json").read_text())
    assert doc["verdict"]["status"] == "error" and doc["verdict"]["passed"] is False
    assert "not healthy" in doc["verdict"]["reason"]
    assert verdict_table(result).endswith("verdict: ERROR — vllm at http://127.0.0.1:9 is not healthy (/health)")
    # ... and a rewrite of the same folder removes the stale one (finding 5: only what exists)
    write_artifacts(result, tmp_path, series=None, records=[], windows=[])
    assert not (tmp_path / "ramp.png").exists()


def test_absent_metrics_show_as_absent_and_every_number_says_what_it_is(tmp_path):
    nan = float("nan")
    lv = LevelStats(users=24, running_mean=19.9, running_max=20, waiting_mean=3.1, waiting_max=5, usage_mean=nan,
                    usage_max=nan, preemptions=None, preemption_rate_per_s=None, samples=30,
                    client_running_mean=19.9, running_source="client", engine_running_mean=15.2,
                    disagreement=4.7, disagrees=True)
    result = ProbeResult(expectation=EXP, levels=[lv], checks=[check("leak", passed=True)])
    table = levels_table(result)
    header = table.splitlines()[1]
    for name in ("running", "from", "engine gauge", "client count", "waiting", "usage gauge", "preemptions"):
        assert name in header
    row = table.splitlines()[3]
    assert "client" in row and "15.20" in row and "client and gauge disagree (+4.70)" in row
    cells = [c.strip() for c in row.split("  ") if c.strip()]
    assert cells.count("—") >= 2 and "0" not in cells  # no usage gauge, no preemption counter: never 0
    write_artifacts(result, tmp_path, series=None, records=[], windows=[])
    level = json.loads((tmp_path / "result.json").read_text())["levels"][0]
    assert level["preemptions"] is None and level["usage_mean"] is None  # null, not 0, not NaN
