"""A report a person reads stays within 120 columns: a check's reason (hundreds of characters when
the client starved a level or the engine disagrees) wraps under its own column, the other columns
stay aligned, and the long single lines (probe error, verdict) wrap with a hanging indent."""

from __future__ import annotations

from pathlib import Path

from kvprobe.probe.run import ProbeResult
from kvprobe.report.console import REPORT_WIDTH, ramp_line, verdict_table, wrap_last_column
from kvprobe.spec.expectation import load_expectations
from kvprobe.tables import render_table
from kvprobe.verdict.checks import CheckResult

REPO = Path(__file__).resolve().parents[2]
EXP = load_expectations(REPO / "expectations" / "emulated-vllm.yaml")[0]
LONG = ("the load generator was the bottleneck at 28 users: loop lag p99 77.0 ms over the 15 ms a level of "
        "requests living 1.20 s tolerates, so the usage gauge it read (79.2% against the ledger's 92.0%) says "
        "nothing about the engine; rerun on a quieter machine, with more --processes, or with kvprobe worker "
        "on another host; the plateau of 20.4 ± 0.3 running requests was seen at 24, 26 and 28 users and the "
        "engine's own gauge agreed within 0.2 at each level, which is the figure the verdict uses")


def _result(error: str | None = None) -> ProbeResult:
    checks = [CheckResult("rejection_point", predicted=20.32, measured=20.4, uncertainty=0.31, binding="kv",
                          passed=True, reason="within 1 of the prediction"),
              CheckResult("usage_gap", predicted=0.92, reported=0.792, inconclusive=True, reason=LONG),
              CheckResult("leak", predicted=0, measured=0, passed=True, reason="the pool drained to 0 blocks")]
    return ProbeResult(expectation=EXP, checks=checks, error=error)


def test_the_reason_wraps_under_its_column():
    assert len(LONG) > 400
    text = verdict_table(_result())
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= REPORT_WIDTH
    header = next(line for line in lines if line.startswith("check "))
    start = header.index("reason")
    row = next(i for i, line in enumerate(lines) if line.startswith("usage_gap"))
    more = []
    for line in lines[row + 1:]:
        if not line.startswith(" " * start):
            break
        more.append(line[start:])
    assert len(more) >= 3  # the reason went on under itself ...
    assert " ".join([lines[row][start:], *more]) == LONG  # ... every word of it, in order
    assert lines[row + 1 + len(more)].startswith("leak ")  # the next check's row follows, aligned
    assert lines[row].index("INCONCLUSIVE") == header.index("status")
    assert lines[row + 1 + len(more)].index("PASS") == header.index("status")


def test_a_long_probe_error_and_verdict_wrap_with_a_hanging_indent():
    text = verdict_table(_result(error="the engine refused: " + LONG))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= REPORT_WIDTH
    at = next(i for i, line in enumerate(lines) if line.startswith("probe error: "))
    assert lines[at + 1].startswith("    ") and not lines[at + 1].startswith("     ")
    assert lines[-1].startswith("    ") and any(line.startswith("verdict: ERROR — ") for line in lines)


def test_a_short_table_is_left_as_it_is():
    table = render_table(["a", "why"], [[1, "short"], [22, "also short"]], title="t")
    assert wrap_last_column(table) == table


def test_wide_leading_columns_keep_a_readable_last_column():
    table = render_table(["x" * 100, "why"], [["y", "word " * 40]])
    wrapped = wrap_last_column(table).splitlines()
    start = wrapped[0].index("why")
    assert all(len(line) <= start + 40 for line in wrapped)  # 40 columns kept for the reason
    assert " ".join(line[start:].strip() for line in wrapped[2:]) == ("word " * 40).strip()


def test_the_ramp_line_says_which_level_a_lagging_client_held_on():
    ramp = {"strategy": "predict", "seconds": 10.0, "lifetimes": 15.2, "note": None,
            "levels": [{"users": 2, "seconds": 2.66, "lifetimes": 4.05, "held_for_lag": False},
                       {"users": 10, "seconds": 4.67, "lifetimes": 7.11, "held_for_lag": True}]}
    line = ramp_line(ramp)
    assert "N=2 4.0, N=10 7.1 (held on: the client lagged)" in line, line
    assert line.count("held on") == 1
