"""Holding a level of the ramp: waited out while the engine and Locust live, and held on past a burst of
load-generator lag from beside the probe (another engine starting on the same cores)."""

from __future__ import annotations

import math
import time
from dataclasses import replace

from kvprobe.analysis import levels as analysis
from kvprobe.analysis.client import starved_so_far
from kvprobe.analysis.steady import window_start
from kvprobe.errors import ProbeError, TargetError
from kvprobe.load.health import HEALTH_PERIOD
from kvprobe.probe.state import ProbeRun


class PastBurst:
    """Holds a level on while its load generator lagged for most of the level so far: read as
    starved (`analysis.client`), the level would leave every check it feeds unjudged. A burst from
    beside the probe (another engine starting on the same cores: loop lag 29-65 ms for several
    seconds against a limit of 25, measured here) ends, and the healthy seconds held after it make
    the level's own. At most STARVED_EXTRA times the level's longest hold more; checked at most
    once a HEALTH_PERIOD, as often as the load writes a lag record (each check reads the records)."""

    def __init__(self, pr: ProbeRun, users: int, t_start: float, longest: float):
        self.pr, self.users, self.t_start, self.longest = pr, users, t_start, longest
        # never past the probe's time budget (pr.deadline is on the monotonic clock, the windows on the wall clock)
        budget = time.time() + (pr.deadline - time.monotonic())
        self.cap = max(longest, min(longest + STARVED_EXTRA * (longest - t_start), budget))
        self._checked, self._healthy = -math.inf, True
        self.held = False  # did the level's lagging client keep it from ending?

    def ends(self, window) -> bool:
        """May the level end with `window`? Yes unless its client is starved so far and the cap allows more."""
        now = window.t_end
        if now >= self.cap:
            return True
        if now - self._checked < HEALTH_PERIOD:
            return self._healthy  # no lag record since the last look
        self._checked = now
        steady = window_start(window, self.pr.exp.profile.hold.warmup)
        self._healthy = not starved_so_far(self.pr.load.records(), window.t_start, steady, now)
        if self._healthy:
            return True
        self.held = True
        if self.longest < self.cap:
            self.pr.log(f"  users {self.users:>4}: the load generator lagged for most of this level so far "
                        "(a burst beside the probe?): holding it on, up to "
                        f"{self.cap - self.t_start:.0f} s, until most of its seconds are healthy")
            self.longest = self.cap
        return False

    def mark(self, window):
        """`window` as the level ended, saying whether its lagging client held it on."""
        return replace(window, held_for_lag=self.held)


STARVED_EXTRA = 1.0


def held_past_burst(pr: ProbeRun, users: int, t_start: float):
    """A level of fixed hold, ended at its hold unless its client was starved so far (`PastBurst`)."""
    past_burst = PastBurst(pr, users, t_start, t_start + pr.hold)
    while True:
        window = analysis.LevelWindow(users=users, t_start=t_start, t_end=time.time())
        if past_burst.ends(window):
            return past_burst.mark(window)
        hold_level(pr.target, pr.load, until=min(past_burst.longest, time.time() + HEALTH_PERIOD))


def hold_level(target, load, *, until: float) -> None:
    """Wait out a level, failing fast when the engine or Locust dies."""
    while (left := until - time.time()) > 0:
        if not target.alive():
            raise TargetError("the engine died during the probe", log_tail=target.log_tail())
        if not load.alive():
            raise ProbeError(f"the Locust subprocess exited during the ramp (rc={load.returncode}): {load.log_tail()}")
        if load.expect_workers:
            load.raise_if_worker_lost()
        time.sleep(min(0.2, left))
