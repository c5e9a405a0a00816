"""Ramp strategies: which user count to run next, given what the levels so far showed.

Pure objects (no I/O, no clocks): `next_level(history)` returns the next closed-loop user count or
None when the ramp is done. The probe measures each level and appends a `LevelResult`; the same
objects therefore drive a static sweep and an adaptive search the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvprobe.errors import ConfigError


@dataclass
class LevelResult:
    users: int
    running: float
    waiting: float
    preemption_rate: float
    saturated: bool  # the engine did not follow N: requests waited (or running stayed below N)


class ExplicitRamp:
    """The levels as written, in order."""

    def __init__(self, levels):
        self.levels = [int(x) for x in levels]
        if not self.levels or any(x < 0 for x in self.levels):
            raise ConfigError(f"explicit ramp needs non-negative user counts, got {list(levels)!r}")

    def planned(self) -> list[int]:
        return list(self.levels)

    def next_level(self, history: list[LevelResult]) -> int | None:
        i = len(history)
        return self.levels[i] if i < len(self.levels) else None


def around_prediction_levels(predicted: float, *, below: int = 4, window: int = 2, above: int = 2,
                             max_users: int | None = None) -> list[int]:
    """Coarse levels below the prediction, every integer within ±window of it, a few above.

    The dense band is where the rejection point should be; the coarse levels show that the engine
    follows N below it, the levels above show the plateau.
    """
    if predicted is None or not predicted > 0 or not math.isfinite(predicted):
        raise ConfigError(f"around-prediction ramp needs a positive predicted limit, got {predicted!r}")
    lo_band = max(1, math.floor(predicted) - window)
    hi_band = math.ceil(predicted) + window
    levels: set[int] = set(range(lo_band, hi_band + 1))
    for k in range(1, below + 1):  # evenly spaced fractions of the band's start
        levels.add(max(1, round(lo_band * k / (below + 1))))
    step = max(1, round(0.1 * predicted))
    for k in range(1, above + 1):
        levels.add(hi_band + k * step)
    out = sorted(x for x in levels if x >= 1)
    if max_users is not None:
        out = [x for x in out if x <= max_users]
    return out


class AroundPrediction(ExplicitRamp):
    def __init__(self, predicted: float, *, below: int = 4, window: int = 2, above: int = 2,
                 max_users: int | None = None):
        self.predicted = predicted
        super().__init__(around_prediction_levels(predicted, below=below, window=window, above=above,
                                                  max_users=max_users))


class BisectRamp:
    """Find the knee — the largest N in [lo, hi] that is not saturated — then confirm it.

    The latest measurement of a level wins, so a confirmation that contradicts an earlier result
    simply reopens the search. `confirm` extra measurements are required of the knee and of
    knee+1 (when it lies inside the range). A cap on the number of levels bounds a flapping engine.
    """

    def __init__(self, lo: int, hi: int, *, confirm: int = 1, max_levels: int | None = None):
        if not (1 <= lo <= hi):
            raise ConfigError(f"bisect ramp needs 1 <= lo <= hi, got lo={lo!r} hi={hi!r}")
        self.lo, self.hi, self.confirm = int(lo), int(hi), max(0, int(confirm))
        span = self.hi - self.lo + 2
        self.max_levels = max_levels or (2 * math.ceil(math.log2(span)) + 2 * self.confirm + 4)

    def _bounds(self, history: list[LevelResult]) -> tuple[int, int, dict[int, int]]:
        latest: dict[int, bool] = {}
        counts: dict[int, int] = {}
        for h in history:
            latest[h.users] = bool(h.saturated)
            counts[h.users] = counts.get(h.users, 0) + 1
        bad = min([u for u, s in latest.items() if s] + [self.hi + 1])
        good = max([u for u, s in latest.items() if not s and u < bad] + [self.lo - 1])
        return good, bad, counts

    def knee(self, history: list[LevelResult]) -> int | None:
        """The largest unsaturated level found so far (None when even `lo` saturates)."""
        good, _bad, _ = self._bounds(history)
        return good if good >= self.lo else None

    def next_level(self, history: list[LevelResult]) -> int | None:
        if len(history) >= self.max_levels:
            return None
        good, bad, counts = self._bounds(history)
        if bad - good > 1:
            return (good + bad) // 2
        # Adjacent: confirm each side that lies inside the range, knee first.
        for level in (good, bad):
            if self.lo <= level <= self.hi and counts.get(level, 0) < 1 + self.confirm:
                return level
        return None


def make_ramp(spec, predicted: float | None):
    """Build the strategy a profile's `RampSpec` names (strategy, levels, below, window, above,
    max_users, confirm)."""
    strategy = getattr(spec, "strategy", None)
    levels = tuple(getattr(spec, "levels", ()) or ())
    max_users = getattr(spec, "max_users", None)
    if strategy == "explicit":
        return ExplicitRamp(levels)
    if strategy == "around-prediction":
        if predicted is None:
            raise ConfigError("ramp strategy 'around-prediction' needs a predicted admission limit")
        return AroundPrediction(predicted, below=spec.below, window=spec.window, above=spec.above,
                                max_users=max_users)
    if strategy == "bisect":
        if len(levels) >= 2:
            lo, hi = int(levels[0]), int(levels[-1])
        else:
            lo = 1
            if max_users is not None:
                hi = int(max_users)
            elif predicted is not None and predicted > 0:
                hi = max(2, math.ceil(2 * predicted))
            else:
                raise ConfigError("ramp strategy 'bisect' needs levels [lo, hi], max_users or a prediction")
        return BisectRamp(lo, hi, confirm=getattr(spec, "confirm", 1))
    raise ConfigError(f"unknown ramp strategy {strategy!r}: expected explicit, around-prediction or bisect here "
                      "(`predict` reads the prediction's limits: kvprobe.probe.strategy.make_ramp)")
