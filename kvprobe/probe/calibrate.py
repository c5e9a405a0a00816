"""Before the ramp: how long one request takes alone (the unit of a hold given in request
lifetimes), how many levels the ramp will run, and so how long each level is held within the
profile's time budget."""

from __future__ import annotations

import math
from statistics import median

from kvprobe.errors import ProbeError
from kvprobe.load.prompts import as_prompt_format
from kvprobe.load.ramps import BisectRamp, make_ramp
from kvprobe.observe import oneshot
from kvprobe.probe.strategy import PredictRamp

# Requests timed alone before a hold given in lifetimes: the median of a few survives one slow
# request on a loaded machine (one 37.6 s calibration once made every level 94 s long).
CALIBRATION_REQUESTS = 3
# Two that agree this closely settle it: a third adds nothing but one more lifetime (12 s each
# for SGLang's long-output shapes here).
CALIBRATION_AGREE = 0.05


def calibrate(target, exp, model: str | None, *, requests: int = 1) -> tuple[float, list[float]]:
    """Seconds one request takes alone: the median of `requests` sequential requests (the unit of a
    hold given in request lifetimes), and every time measured."""
    dialect = target.dialect
    shape = exp.profile.request
    times = []
    for i in range(requests):
        body = dialect.completion_body(oneshot.unique_prompt(shape.prompt_tokens, i), shape.output_tokens, model=model,
                                       stream=True)
        body = as_prompt_format(body, getattr(target, "prompt_format", "ids"))
        shot = oneshot.post_completion(target.url, body, path=dialect.COMPLETIONS_PATH, headers=target.headers,
                                       timeout=120)
        if not shot.ok:
            raise ProbeError(f"calibration request failed: HTTP {shot.status} {shot.body[:300]}")
        if (shot.prompt_tokens, shot.completion_tokens) != (shape.prompt_tokens, shape.output_tokens):
            raise ProbeError(
                f"calibration usage {shot.prompt_tokens}/{shot.completion_tokens} != requested "
                f"{shape.prompt_tokens}/{shape.output_tokens}: the engine does not honour fixed lengths"
            )
        times.append(shot.seconds)
        if len(times) == 2 and abs(times[0] - times[1]) <= CALIBRATION_AGREE * max(times):
            break
    return median(times), times


def planned_levels(exp, predicted: float | None) -> int:
    """How many levels the profile's ramp will run: its plan, or a bisection's usual length."""
    if exp.profile.ramp.strategy == "predict":
        return len(PredictRamp(predicted).planned())
    ramp = make_ramp(exp.profile.ramp, predicted)
    if isinstance(ramp, BisectRamp):
        return math.ceil(math.log2(ramp.hi - ramp.lo + 2)) + 2 * ramp.confirm
    return max(1, len(ramp.planned()))


def hold_seconds(exp, lifetime: float | None, *, levels: int | None = None,
                 remaining: float | None = None) -> tuple[float, str | None]:
    """Seconds per level, and a message when the time budget capped it. A hold in lifetimes is
    capped so that `levels` levels and the drain fit the `remaining` seconds of the budget."""
    hold = exp.profile.hold
    if not hold.lifetimes:
        return float(hold.seconds), None
    wanted = max(hold.lifetimes * (lifetime or 1.0), 2.0)
    if levels is None or remaining is None:
        return wanted, None
    cap = (remaining - exp.profile.drain_seconds) / max(1, levels)
    if wanted <= cap:
        return wanted, None
    capped = max(cap, 2.0)
    note = (f"hold capped at {capped:.1f}s per level by the time budget ({levels} levels in {remaining:.0f}s left "
            f"of budget_seconds {exp.profile.budget_seconds:g}); {hold.lifetimes:g} lifetimes would be {wanted:.1f}s")
    if lifetime and capped < lifetime:
        note += f"; shorter than one request ({lifetime:.2f}s): raise budget_seconds for a steady state"
    return capped, note
