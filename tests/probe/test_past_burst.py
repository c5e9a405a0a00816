"""A level whose load generator lagged for a burst is held on past it, not lost: the ramp asks the
same question the judgement asks afterwards (`analysis.client.mark_levels`: most of the level's
steady seconds saturated), while it holds the level, on the load's own lag records."""

from __future__ import annotations

import time
from types import SimpleNamespace

from kvprobe.analysis.client import mark_levels, starved_so_far
from kvprobe.analysis.levels import LevelWindow
from kvprobe.load.records import Record
from kvprobe.probe.hold import STARVED_EXTRA, PastBurst, held_past_burst

LIFETIME = 2.0  # seconds: the lag limit is then the floor of 15 ms or the lifetime's share


def requests(t0: float, t1: float) -> list[Record]:
    """Completed requests of LIFETIME sent over [t0, t1] (what the lag limit is scaled by)."""
    return [Record(kind="request", status=200, t_send=t, t_end=t + LIFETIME) for t in range(int(t0), int(t1))]


def lags(t0: float, seconds: int, bad: set[int], worker: str = "w0", lag_ms: float = 60.0) -> list[Record]:
    """One lag record a second from t0; seconds in `bad` lag `lag_ms`, the rest 3 ms."""
    return [Record(kind="lag", worker=worker, t=t0 + s + 0.5, cpu=0.2, lag_ms=lag_ms if s in bad else 3.0)
            for s in range(seconds)]


def test_starved_so_far_is_what_the_judgement_reads_of_the_same_window():
    recs = requests(0, 10) + lags(0, 10, bad={3, 4, 5, 6, 7})
    for steady, bad_majority in ((3.0, True), (0.0, False), (5.0, True)):
        level = SimpleNamespace(users=20, t_start=0.0, t_end=10.0, t_steady=steady)
        mark_levels([level], recs, warmup_fraction=0.3)
        assert level.client_saturated is bad_majority
        assert starved_so_far(recs, 0.0, steady, 10.0) is bad_majority


def test_a_coordinating_process_and_other_kinds_of_record_are_not_read_as_lag():
    recs = requests(0, 10) + lags(0, 10, bad=set(range(10)), worker="master")
    assert not starved_so_far(recs, 0.0, 0.0, 10.0)
    assert starved_so_far(recs + lags(0, 10, bad=set(range(10))), 0.0, 0.0, 10.0)


class FakeProbe:
    def __init__(self, records, budget_s: float = 600.0, hold: float = 8.0):
        self.load = SimpleNamespace(records=lambda: records, alive=lambda: True, expect_workers=0)
        self.target = SimpleNamespace(alive=lambda: True)
        self.exp = SimpleNamespace(profile=SimpleNamespace(hold=SimpleNamespace(warmup=0.3)))
        self.hold = hold
        self.deadline = time.monotonic() + budget_s
        self.lines: list[str] = []

    def log(self, line: str) -> None:
        self.lines.append(line)


def window(t_end: float, t_steady: float = 2.0) -> LevelWindow:
    return LevelWindow(users=26, t_start=0.0, t_end=t_end, t_steady=t_steady)


def test_a_level_starved_so_far_is_held_on_until_most_of_its_seconds_are_healthy():
    # a burst over the level's first six steady seconds (2-8), healthy after it
    t0 = time.time() - 100  # the windows' wall clock: well inside the probe's budget
    recs = requests(t0, t0 + 30) + lags(t0, 30, bad=set(range(2, 8)))
    pr = FakeProbe(recs)
    at = lambda t: LevelWindow(users=26, t_start=t0, t_end=t0 + t, t_steady=t0 + 2.0)  # noqa: E731
    held = PastBurst(pr, 26, t0, longest=t0 + 8.0)
    assert not held.ends(at(8.0))  # 6 of 6 steady seconds lagged: hold on
    assert held.longest == held.cap == t0 + 8.0 + STARVED_EXTRA * 8.0
    assert len(pr.lines) == 1 and "holding it on" in pr.lines[0]
    assert not held.ends(at(8.5))  # within a second of the last look: the same answer, no re-read
    assert not held.ends(at(13.0))  # 6 of 11 seconds still lagged
    assert held.ends(at(15.0))  # 6 of 13: most seconds healthy, the level may end
    assert len(pr.lines) == 1
    assert held.mark(at(15.0)).held_for_lag and held.mark(at(15.0)).t_end == t0 + 15.0


def test_a_level_does_not_end_on_a_look_its_last_unwritten_second_could_overturn():
    # What a clean clone's SGLang probe met: steady from 2 s, its seconds at 2.5 (lagged) and 3.5
    # (healthy) written, the one at 4.5 (lagged) still in the load's buffer when the level may end
    # at 4.8. Ended there, the judgement read 2 of 3 seconds lagged and the level starved.
    t0 = time.time() - 100
    written = requests(t0, t0 + 10) + lags(t0, 4, bad={2})
    pr = FakeProbe(written)
    at = lambda t: LevelWindow(users=26, t_start=t0, t_end=t0 + t, t_steady=t0 + 2.0)  # noqa: E731
    assert not starved_so_far(written, t0, t0 + 2.0, t0 + 4.4)  # under a second since 3.5: nothing unseen
    held = PastBurst(pr, 26, t0, longest=t0 + 4.8)
    assert not held.ends(at(4.8))  # 1 of 2 written, one unseen: the judgement could read most lagged
    everything = requests(t0, t0 + 10) + lags(t0, 5, bad={2, 4})
    level = SimpleNamespace(users=26, t_start=t0, t_end=t0 + 4.8, t_steady=t0 + 2.0)
    mark_levels([level], everything, warmup_fraction=0.3)
    assert level.client_saturated  # as the judgement reads it once the second is written
    healthy = requests(t0, t0 + 10) + lags(t0, 4, bad=set())
    assert PastBurst(FakeProbe(healthy), 26, t0, longest=t0 + 4.8).ends(at(4.8))  # no second could tip it


def test_a_client_that_stays_starved_ends_the_level_at_the_cap():
    t0 = time.time() - 100
    recs = requests(t0, t0 + 40) + lags(t0, 40, bad=set(range(40)))
    held = PastBurst(FakeProbe(recs), 26, t0, longest=t0 + 8.0)
    at = lambda t: LevelWindow(users=26, t_start=t0, t_end=t0 + t, t_steady=t0 + 2.0)  # noqa: E731
    assert not held.ends(at(8.0)) and not held.ends(at(15.9))
    assert held.ends(at(held.cap - t0))  # then the judgement reads it as starved, with the reason


def test_a_healthy_level_ends_when_its_own_rules_say_so():
    t0 = time.time() - 100
    held = PastBurst(FakeProbe(requests(t0, t0 + 10) + lags(t0, 10, bad={4})), 26, t0, longest=t0 + 8.0)
    assert held.ends(LevelWindow(users=26, t_start=t0, t_end=t0 + 6.0, t_steady=t0 + 2.0))
    assert held.longest == t0 + 8.0  # never lengthened
    assert not held.mark(LevelWindow(users=26, t_start=t0, t_end=t0 + 6.0)).held_for_lag


def test_the_hold_on_never_passes_the_probes_time_budget():
    t0 = time.time()
    held = PastBurst(FakeProbe([], budget_s=3.0), 26, t0, longest=t0 + 8.0)
    assert held.cap == t0 + 8.0  # the budget ends sooner than the longest hold: no extension
    held = PastBurst(FakeProbe([], budget_s=12.0), 26, t0, longest=t0 + 8.0)
    assert t0 + 11.5 < held.cap < t0 + 12.5


def test_a_level_of_fixed_hold_reads_its_steady_part_by_the_warmup_share():
    # held 10 s from 19.5 s ago: its hold is over, and with the warm-up share 0.3 of 19.5 s its
    # steady part (from 5.85 s) holds 4 lagged seconds (6-9) against 10 healthy ones: it ends now
    t0 = time.time() - 19.5
    pr = FakeProbe(requests(t0, t0 + 19) + lags(t0, 19, bad=set(range(10))), hold=10.0)
    window = held_past_burst(pr, 26, t0)
    assert window.t_end - t0 < 20.0 and not pr.lines and not window.held_for_lag


def test_a_level_of_fixed_hold_starved_throughout_is_held_to_the_cap():
    t0 = time.time() - 19.5
    pr = FakeProbe(requests(t0, t0 + 19) + lags(t0, 19, bad=set(range(19))), hold=10.0)
    window = held_past_burst(pr, 26, t0)  # holds on the last half second to its cap, 2 x 10 s
    assert window.t_end >= t0 + 10.0 + STARVED_EXTRA * 10.0
    assert len(pr.lines) == 1 and "holding it on" in pr.lines[0]
    assert window.held_for_lag  # the ramp's record of the level says why it took so long
