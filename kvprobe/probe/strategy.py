"""The ramp that spends the prediction (`strategy: predict`), and the rule that ends a ramp.

The plateau is estimated from deep levels only (`kvprobe.analysis.plateau`: a level counts fully
once its queue rarely empties), so levels spread below and around the prediction cost time and
add nothing to the verdict. This ramp runs only the levels below the knee the analysis needs
(short: one request lifetime each), then goes straight to a level deep past the predicted knee.
Its running either lands near the prediction (confirmed: one more deep level) or it does not
(refuted: the remaining levels are placed from what was measured, and a deep level that did not
saturate at all starts a doubling search, prediction-free).
The ramp then stops as soon as the rejection point's verdict is settled (`settled`) — added deep
levels only while it is not.

Below the knee, the analysis needs one level (the hinge fit's closed-loop duty cycle:
`plateau.fit_hinge`, and step queueing: `plateau.step_waiting_per_user`): half the limit. When the
`no_preemption` check is selected it needs the predicted no-preemption limit less the tolerance
too (the lowest clean level that passes it), which serves alone when it is itself well below the
knee.
"""

from __future__ import annotations

import math

from kvprobe.analysis.plateau import STEP_QUEUE_SHARE, deep_waiting
from kvprobe.errors import ConfigError
from kvprobe.load import ramps

# A closed-loop user keeps a request in the engine for ~90-97% of its cycle (the hinge fit's
# `follow` on the emulators and the shadows); the lower end places a level past the knee when
# the user spends more of its cycle between requests.
FOLLOW_GUESS = 0.9
# A deep level whose running lies this far from the prediction (and at least REFUTED_MIN requests)
# refutes it: the knee is elsewhere and the levels are placed from the measurement.
REFUTED_SHARE = 0.2
REFUTED_MIN = 2.0
LOW_SHARE = 0.5  # the level below the knee, as a share of the limit: well below it (≤ 0.75, see step queueing)
DEEP_LEVELS = 2  # plateau.MIN_DEEP_LEVELS: what confirms a plateau


def deep_users(limit: float) -> int:
    """The fewest users whose closed loop keeps a queue of deep_waiting(limit) past the knee:
    N ≥ limit / follow + D (`plateau.deep_levels_to_add`, in the fluid limit)."""
    return math.ceil(limit / FOLLOW_GUESS + deep_waiting(limit))


MAX_LEVELS = 12  # a bound on a plan that keeps finding the engine elsewhere (each level holds at least a lifetime)
QUEUED_SHARE = 0.5  # of deep_waiting: a deep level past the knee shows at least this queue in the engine
FED_SHARE = 0.5  # a closed loop keeps ~90-97% of its users' requests in the engine (running + waiting)


def fed(level: ramps.LevelResult) -> bool:
    """The engine held the level's load: running + waiting at least FED_SHARE of the users. A
    level the load generator did not deliver (Locust still spawning, or starved) shows a low
    running and no queue — read as saturation, it would place every later level from nothing."""
    return level.running + level.waiting >= FED_SHARE * level.users


def _fresh(users: int, step: int, measured: set[int]) -> int:
    """`users`, or the first level `step` apart above it that was not measured yet."""
    while users in measured:
        users += max(1, step)
    return users


class PredictRamp:
    """The one level below the knee first (short), then deep levels past the predicted knee; a
    search only when a deep level refutes the prediction. `note` says when and why the plan left
    the prediction."""

    def __init__(self, predicted: float, *, clean_limit: float | None = None, tolerance: float = 1.0,
                 max_users: int | None = None):
        if predicted is None or not predicted > 0 or not math.isfinite(predicted):
            raise ConfigError(f"ramp strategy 'predict' needs a positive predicted limit, got {predicted!r}")
        self.predicted = float(predicted)
        self.clean_limit = clean_limit
        self.tolerance = tolerance
        self.max_users = max_users
        self.note: str | None = None

    def planned(self) -> list[int]:
        """The levels when the prediction holds (the hold is sized for this many)."""
        first = deep_users(self.predicted)
        return [*sorted(self._below(self.predicted)), first, first + math.ceil(deep_waiting(self.predicted))]

    def next_level(self, history: list[ramps.LevelResult]) -> int | None:
        """The next level, never one already measured: the load generator reports a level it is
        already at as reached at its first arrival, so a repeated level would hold no time at all."""
        if len(history) >= MAX_LEVELS:
            self.say(f"stopped after {MAX_LEVELS} levels")
            return None
        measured = {h.users for h in history}
        # Upwards first: stopping streaming users blocks Locust's loop (1.6 s for 14 users measured
        # here), which starves the level after a step down; the levels below the knee are short.
        for n in sorted(self._below(self.predicted)):
            if n not in measured:
                return self._cap(n)
        first = deep_users(self.predicted)
        if not any(h.users >= first for h in history):
            return self._cap(first)
        step = math.ceil(deep_waiting(self.predicted))
        for h in history:
            if not fed(h):
                self.say(f"N={h.users} held fewer than half its users' requests in the engine (the load did "
                         "not reach it): not read as the engine's limit")
        seen = [h for h in history if fed(h)]
        # saturated as the engine's limit: a queue in the engine; running far below N without one
        # is a load generator that held the requests back (a busy machine), and refutes nothing
        queued = QUEUED_SHARE * deep_waiting(self.predicted)
        saturated = [h for h in seen if h.saturated and h.waiting >= queued]
        for h in seen:
            if h.saturated and h.waiting < queued and h.users >= first:
                self.say(f"N={h.users} ran {h.running:.1f} with no queue in the engine (the load generator held "
                         "the requests): not read as the engine's limit")
        if not saturated:
            top = max((h.users for h in seen if h.users >= first and not h.saturated), default=None)
            if top is None:  # no deep level showed the engine's limit: the next one, still from the prediction
                return self._cap(_fresh(first + step, step, measured))
            self.say(f"N={top} did not saturate the engine (predicted limit {self.predicted:g}): "
                     "searching by doubling")
            return self._cap(_fresh(2 * top, step, measured))
        deepest = max(saturated, key=lambda h: h.users)
        basis = self.predicted
        if abs(deepest.running - basis) > max(REFUTED_SHARE * basis, REFUTED_MIN):
            basis = deepest.running
            self.say(f"the deepest level ran {deepest.running:.1f} where {self.predicted:g} was predicted: "
                     "the remaining levels are placed from the measurement")
        first = deep_users(basis)
        step = math.ceil(deep_waiting(basis))
        # deep as the analysis reads it: a queue of its own, not just N past the knee (a starved
        # load generator holds the queue in the client, and the plateau stays unconfirmed)
        queued = QUEUED_SHARE * deep_waiting(basis)
        deep = sorted(h.users for h in saturated if h.users >= first and h.waiting >= queued)
        if len(deep) < DEEP_LEVELS:
            return self._cap(_fresh(deep[-1] + step if deep else first, step, measured))
        return next((n for n in self._below(basis) if n not in measured), None)

    def _below(self, basis: float) -> list[int]:
        """The levels below the knee the analysis and the selected checks need: one well below it
        (the hinge fit, step queueing), and with no_preemption its clean level, which serves as both
        when it is itself well below the knee. A clean level near the knee is judged on its queue
        beyond step queueing, read only from a level well below (`plateau.step_waiting_per_user`):
        SGLang's streams count a request as waiting until its first token, ~0.5 of 20 users at the
        shadow's 2 s lifetime, which alone reads N=20 as waiting against a clean limit of 21."""
        low = max(1, round(LOW_SHARE * basis))
        if self.clean_limit is None:
            return [low]
        clean = max(1, math.ceil(self.clean_limit * basis / self.predicted - self.tolerance))
        return [clean] if clean <= STEP_QUEUE_SHARE * basis else sorted({low, clean})

    def say(self, line: str) -> None:
        if line not in (self.note or ""):
            self.note = f"{self.note}; {line}" if self.note else line

    def _cap(self, users: int) -> int | None:
        return None if self.max_users is not None and users > self.max_users else users


# The share of the allowance the plateau's ~95% half-width must be within before a verdict counts
# as settled by default. Then more data cannot turn it, whatever the gap; a narrower half-width is
# the profile's to ask for (`ramp.uncertainty`): the prediction-free ramps' fixed holds reach one
# that shrinks with the knee's share of the allowance (±0.46 of 1.2 at knee~24, ±0.53 of 2.9 at
# knee~58 on the emulated vLLM, bench_ramps), which no one share of the allowance matches.
SAFE_SHARE = 0.65


def widest(allowance: float, target: float | None = None) -> float:
    """The widest ~95% half-width a settled verdict may have: SAFE_SHARE of the allowance, or the
    profile's `ramp.uncertainty` when that is narrower."""
    safe = SAFE_SHARE * allowance
    return safe if target is None else min(safe, target)


def settled(rejection, predicted: float, allowance: float, target: float | None = None) -> bool:
    """The rejection point's verdict can no longer change with more data of the same quality: the
    plateau is confirmed, its ~95% half-width is within `widest`, and its interval lies wholly
    inside the tolerance around the prediction, or wholly outside it
    (`verdict.checks.check_rejection_point` reads the same figures)."""
    if not rejection.confirmed or rejection.rejection_point is None or rejection.uncertainty is None:
        return False
    if rejection.uncertainty > widest(allowance, target):
        return False
    gap = abs(rejection.rejection_point - predicted)
    return gap + rejection.uncertainty <= allowance or gap - rejection.uncertainty > allowance


def usage_agrees(levels, deep_levels, tolerance: float) -> bool:
    """Do the deep levels agree on the usage gauge where admission stopped, within the usage_gap
    check's tolerance? The check reads their weighted median, which of two levels that disagree is
    the lower one: a level held only a lifetime or two can read the gauge a few points low (91%
    against 97% at N=37 on the vLLM shadow's gpu-memory-utilization shape), so a third deep level
    decides instead. Three or more, or a target without the gauge, settle it."""
    deep = set(deep_levels)
    usage = [lv.usage_mean for lv in levels
             if lv.users in deep and lv.usage_mean is not None and math.isfinite(lv.usage_mean)]
    return len(usage) < 2 or len(usage) >= 3 or max(usage) - min(usage) <= tolerance


def make_ramp(spec, prediction, *, tolerance: float = 1.0, checks=()):
    """The strategy a profile's `RampSpec` names; `predict` reads the prediction's limits."""
    limit = None if prediction is None else prediction.limit
    if getattr(spec, "strategy", None) != "predict":
        return ramps.make_ramp(spec, limit)
    if limit is None:
        raise ConfigError("ramp strategy 'predict' needs a predicted admission limit")
    clean = prediction.no_preemption_limit if "no_preemption" in checks else None
    return PredictRamp(limit, clean_limit=clean, tolerance=tolerance, max_users=getattr(spec, "max_users", None))
