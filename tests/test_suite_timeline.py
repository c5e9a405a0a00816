"""The run's timeline (tests/suite_timeline.py) from the holds the lanes log (kvprobe.load.turns)."""

from __future__ import annotations

import json

from kvprobe.load import turns
from tests import suite_timeline


def test_covered_counts_overlaps_once():
    assert suite_timeline.covered([(0, 10), (5, 20), (30, 40), (32, 35)]) == 30
    assert suite_timeline.covered([]) == 0


def test_summary_names_the_turns_share_the_quiet_time_and_the_modules_that_held_it_longest():
    holds = [
        {"kind": "turn", "start": 0, "end": 120, "waited": 0, "who": "tests/a.py::t1", "worker": "gw0"},
        {"kind": "turn", "start": 120, "end": 250, "waited": 90, "who": "tests/b.py::t2", "worker": "gw1"},
        {"kind": "turn", "start": 250, "end": 300, "waited": 0, "who": "tests/b.py::t3", "worker": "gw1"},
        {"kind": "turn", "start": 300, "end": 330, "waited": 5, "who": "tests/a.py::t1", "worker": "gw0"},
        {"kind": "lane", "start": 0, "end": 330, "waited": 0, "who": "tests/a.py::t1", "worker": "gw0"},
        {"kind": "lane", "start": 30, "end": 300, "waited": 0, "who": "tests/b.py::t2", "worker": "gw1"},
        {"kind": "quiet", "start": 400, "end": 460, "waited": 60, "who": "tests/c.py::q", "worker": "gw1"},
    ]
    lines = suite_timeline.summary(holds, 600)
    assert lines[0].startswith("wall 10.0 min: the load turn held 5.5 min (55%), a lane alone "
                               "(needs_a_quiet_machine) 1.0 min")
    assert lines[1] == "gw0: lane tests 5.5 min, of which waiting for the turn 0.1 min"
    assert lines[2] == "gw1: lane tests 5.5 min, of which waiting for the turn 1.5 min"
    assert lines[3] == "held the turn longest: tests/b.py 180 s; tests/a.py 150 s"  # by module


def test_no_holds_no_lines(tmp_path):
    assert suite_timeline.summary([], 100) == []
    assert suite_timeline.read_holds(tmp_path / "absent.log") == []


def test_a_torn_line_is_skipped(tmp_path):
    log = tmp_path / "turn.log"
    log.write_text(json.dumps({"kind": "turn", "start": 1, "end": 2, "waited": 0, "who": "x"}) + '\n{"kind": "tu')
    assert [h["who"] for h in suite_timeline.read_holds(log)] == ["x"]


def test_a_turn_held_is_logged_with_its_holder(tmp_path, monkeypatch):
    log = tmp_path / "turn.log"
    monkeypatch.setenv(turns.TURN_LOG_ENV, str(log))
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/x.py::test_y (call)")
    with turns.load_turn(path=str(tmp_path / "turn")):
        pass
    with turns.load_turn(path=""):  # no turn: nothing held, nothing logged
        pass
    (hold,) = suite_timeline.read_holds(log)
    assert hold["kind"] == "turn" and hold["who"] == "tests/x.py::test_y"
    assert hold["end"] >= hold["start"] and hold["waited"] >= 0


def test_without_a_log_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(turns.TURN_LOG_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    turns.log_hold("turn", 1.0, 2.0, 0.0)
    assert list(tmp_path.iterdir()) == []
