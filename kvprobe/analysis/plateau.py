"""The rejection point: where running stops following N, and the plateau it reaches.

numpy only, no I/O; the input is `kvprobe.analysis.levels.LevelStats` per level (any object with
`users`, `running_mean`, `running_se`, `waiting_mean`, `waiting_max`, `usage_mean`, `preemptions`,
`too_few_samples`).

Why not just average the levels that wait: in a closed loop the queue empties now and then
while only a request or two wait, and every time it does a slot stands idle, so running at the
edge of saturation sits below the plateau the engine holds once requests always wait (measured
on real vLLM: 23.79 averaged over every waiting level, 24.1–24.2 deep in saturation). So:

1. A hinge fit (running = min(follow × N, plateau)) gives the closed-loop duty cycle `follow`;
   when levels it put on the plateau wait for nobody, the line is refitted on every level below
   the first that waits.
2. Waiting that is mere queueing for the next step grows in proportion to N up to the knee and
   no further (Little's law: it follows the arrivals, which the plateau caps); its rate per user is
   read from levels well below the knee and taken off every level ("excess waiting").
3. The saturated levels are every level from the lowest N from which every higher level waits
   (excess ≥ 0.5) — none is left out as "clean" or "transient" while a higher one waits.
4. The plateau is their mean weighted by depth — min(1, depth / D)², D = `deep_waiting` — and
   by the inverse variance of each level's mean (`weighted_plateau`),
   where a level's depth is the smaller of its excess waiting and the queue a closed loop past
   its knee must hold, (follow × N − plateau) / follow (`queue_depth`). A level whose queue
   rarely empties (depth ≥ D) counts fully; one where barely a request waits, or that waits
   only from a burst below the knee, hardly at all. Depth depends on the plateau, so the
   estimate is iterated to a fixed point.
5. Its uncertainty combines each level's own standard error (batch means over its window) with
   the level-to-level scatter, scaled up when the levels disagree beyond their errors (the
   Particle Data Group's scale factor) and down when they agree better than those errors allow
   (`agreement_scale`); `uncertainty` is the half-width of a ~95% interval.
6. It is `confirmed` when at least MIN_DEEP_LEVELS levels are deep; the probe's ramp adds deep
   levels until it is (`deep_levels_to_add`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

Z95 = 1.96
MIN_DEEP_LEVELS = 2  # deep levels needed before a plateau counts as confirmed
TARGET_DEEP_LEVELS = 3  # what the probe's ramp aims for when it adds levels
# A constant gauge (a request cap) still has some uncertainty: a level's error, and the plateau's. Every
# level reads the same gauge of the same engine, so this part does not average away over levels.
SE_FLOOR = 0.01


@dataclass
class RejectionPoint:
    rejection_point: float | None  # the plateau estimate (depth-weighted), None when nothing saturated
    last_clean_users: int | None  # highest N below the onset with no excess waiting and no preemption
    plateau: float | None  # plain mean of running over the saturated levels (for the record)
    saturated_levels: list[int]  # every level from the onset on (each of them waits)
    usage_at_rejection: float | None  # the usage gauge on the plateau (weighted median), where admission stopped
    onset_users: int | None = None  # lowest N from which every higher level waits
    plateau_spread: float | None = None  # max - min of running over those levels (falling: stuck admission)
    transient_levels: list[int] = field(default_factory=list)  # waited once, but a higher level did not
    preempting_levels: list[int] = field(default_factory=list)
    skipped_levels: list[int] = field(default_factory=list)  # too few samples
    levels_seen: list[int] = field(default_factory=list)  # every usable level, ascending
    follow: float | None = None  # fitted running/N below the knee (closed-loop duty cycle)
    uncertainty: float | None = None  # ± half-width of a ~95% interval around rejection_point
    deep_levels: list[int] = field(default_factory=list)  # saturated levels with excess waiting >= deep_waiting
    deep_waiting: float | None = None  # D: the excess waiting from which a level counts fully
    step_waiting_per_user: float = 0.0  # waiting per user that is only queueing for the next step
    weights: dict[int, float] = field(default_factory=dict)  # users -> weight in the estimate
    scale: float | None = None  # level-to-level scatter against the levels' own errors (1: consistent)
    confirmed: bool = False  # at least MIN_DEEP_LEVELS deep levels


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value at half the total weight: a level whose gauge read oddly (a sampled gauge, a
    stall) does not move the gauge reading the verdict compares."""
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, cum[-1] / 2)])


def deep_waiting(plateau: float) -> float:
    """Excess waiting from which a level's queue rarely empties: max(2, √C / 2) for a plateau C
    (the queue's fluctuations grow with the square root of the number of slots)."""
    return max(2.0, 0.5 * math.sqrt(max(plateau, 0.0)))


def fit_hinge(users: np.ndarray, running: np.ndarray) -> tuple[float, float, int, float, float]:
    """Least-squares fit of running = min(follow × N, plateau), levels sorted by N.

    Returns (follow, plateau, knee_index, sse_hinge, sse_line): levels [knee_index:] are on the
    plateau; `sse_line` is the error of a plain line through the origin (no plateau at all).
    Closed-loop clients never run at exactly N (each user spends part of its cycle between
    requests, and a request waits a step before it is scheduled), so `follow` is fitted, not 1.
    """
    n = users.size
    line = line_through_origin(users, running)
    sse_line = float(np.sum((running - line * users) ** 2))
    best = (line, float("inf"), n, sse_line)
    for k in range(1, n):
        lo_n, lo_r = users[:k], running[:k]
        follow = line_through_origin(lo_n, lo_r)
        plateau = float(running[k:].mean())
        sse = float(np.sum((lo_r - follow * lo_n) ** 2) + np.sum((running[k:] - plateau) ** 2))
        if sse < best[3]:
            best = (follow, plateau, k, sse)
    follow, plateau, knee, sse = best
    return follow, plateau, knee, sse, sse_line


STEP_QUEUE_SHARE = 0.75  # levels at most this share of the knee's users show step queueing only


def step_waiting_per_user(levels, follow: float, plateau: float) -> float:
    """Median waiting/N over levels well below the knee (N ≤ STEP_QUEUE_SHARE × plateau / follow): a
    request that arrives mid-step waits for the next one, at every load, in proportion to the arrivals."""
    knee_users = plateau / follow if follow > 0 else plateau
    low = [lv.waiting_mean / lv.users for lv in levels
           if lv.users > 0 and lv.users <= STEP_QUEUE_SHARE * knee_users and np.isfinite(lv.waiting_mean)]
    return max(0.0, float(np.median(low))) if low else 0.0


def step_waiting(users: np.ndarray, base: float, follow: float, plateau: float) -> np.ndarray:
    """Waiting that is only queueing for the next step at each level: `base` per user up to the knee
    and no more past it. By Little's law that queue is the arrival rate times the wait for a step, and
    a closed loop's arrivals grow with N only until the plateau caps its throughput (an earlier
    `base × N` took a queue that grew with N's arrivals past the knee off every deep level: on a busy
    machine, where the wait for a first token is long at every level, it took the whole queue)."""
    knee_users = plateau / follow if follow > 0 else plateau
    return base * np.minimum(users, max(knee_users, 0.0))


def line_through_origin(users: np.ndarray, running: np.ndarray) -> float:
    return float(np.dot(users, running) / np.dot(users, users))


def queue_depth(users: np.ndarray, excess: np.ndarray, follow: float, plateau: float) -> np.ndarray:
    """How many requests a level keeps queued beyond step queueing: the smaller of what it showed
    (excess waiting) and what a closed loop past its knee must queue, (follow × N − plateau) /
    follow. Below the knee a burst can queue a request or two while running still follows N —
    such a level waits, but says little about the plateau."""
    fluid = (follow * users - plateau) / follow if follow > 0 else users - plateau
    return np.clip(np.minimum(np.nan_to_num(excess, nan=0.0), fluid), 0.0, None)


def _preempted(lv) -> bool:
    return lv.preemptions is not None and lv.preemptions > 0


# A level waits when its queue beyond step queueing reaches this many requests on average; below
# it, and without preemption, it ran clean (the no_preemption check's figure).
CLEAN_WAITING = 0.5


def queue_seen(lv) -> bool:
    """Did the engine's queue gauge read a request waiting at any sample of the level? One that read
    zero throughout kept nobody waiting through a moment it publishes at (SGLang's: after a prefill's
    admissions and every 40 decode steps): the streams' waiting there (sent, not yet admitted by the
    first token less the lead, `levels.client_side_means`) is the way from the client to the
    scheduler and back, which grows with the arrivals — on the SGLang shadow 0.14 at N=10 and
    0.31-0.51 at N=20, below a knee of 21, each from one cohort of requests — not a queue. No gauge: the
    streams decide."""
    top = lv.waiting_max
    return top is None or not np.isfinite(top) or top > 0


def find_rejection_point(levels, *, waiting_threshold: float = CLEAN_WAITING, min_gap: float = 1.0) -> RejectionPoint:
    """The plateau of running over every level that waits, weighted by depth, with its uncertainty.

    The engine is saturated when the levels from the onset on wait and running there falls at
    least `min_gap` requests below the closed-loop line; otherwise there is no rejection point.
    """
    usable = sorted((lv for lv in levels if not lv.too_few_samples and np.isfinite(lv.running_mean)),
                    key=lambda lv: lv.users)
    skipped = sorted(lv.users for lv in levels if lv not in usable)
    seen = [lv.users for lv in usable]
    preempting = [lv.users for lv in usable if _preempted(lv)]
    if len(usable) < 2:
        return RejectionPoint(None, None, None, [], None, preempting_levels=preempting,
                              skipped_levels=skipped, levels_seen=seen)
    users = np.array([lv.users for lv in usable], dtype=float)
    running = np.array([lv.running_mean for lv in usable], dtype=float)
    follow, plateau0, knee, _sse, _sse_line = fit_hinge(users, running)
    waiting = np.array([lv.waiting_mean for lv in usable], dtype=float)
    seen_queue = np.array([queue_seen(lv) for lv in usable])
    for _ in range(2):
        base = step_waiting_per_user(usable, follow, plateau0)
        excess = waiting - step_waiting(users, base, follow, plateau0)
        waits = np.isfinite(excess) & (excess >= waiting_threshold) & seen_queue
        onset = len(usable)
        while onset > 0 and waits[onset - 1]:
            onset -= 1
        if onset <= knee:
            break
        # Levels the fit put on the plateau wait for nobody, so running there still follows N: one
        # low level (a first level read while the machine was busy) must not bend the line that
        # decides how far the waiting levels fall below it. Refit the line on every level below the onset.
        follow, knee = line_through_origin(users[:onset], running[:onset]), onset
        plateau0 = float(running[onset:].mean()) if onset < len(usable) else plateau0
    saturated = usable[onset:]
    shortfall = follow * users[onset:] - running[onset:]
    transient = [lv.users for lv, w in zip(usable[:onset], waits[:onset], strict=True) if w]
    clean = [lv.users for lv, w in zip(usable[:onset], waits[:onset], strict=True) if not w and not _preempted(lv)]
    common = {"transient_levels": transient, "preempting_levels": preempting, "skipped_levels": skipped,
              "levels_seen": seen, "follow": follow, "step_waiting_per_user": base}
    if not saturated or shortfall.max() < min_gap:
        return RejectionPoint(None, max(clean) if clean else None, None, [], None, **common)
    errors = [lv.running_se for lv in saturated]
    estimate = plateau0
    for _ in range(4):  # the depth of a level depends on the plateau: iterate to a fixed point
        deep = deep_waiting(estimate)
        depth = queue_depth(users[onset:], excess[onset:], follow, estimate)
        weights = np.minimum(1.0, depth / deep) ** 2
        previous, (estimate, half, scale) = estimate, weighted_plateau(running[onset:], weights, errors)
        if abs(estimate - previous) < 1e-3:
            break
    usage = np.array([lv.usage_mean for lv in saturated], dtype=float)
    has = np.isfinite(usage) & (weights > 0)
    deep_levels = [lv.users for lv, x in zip(saturated, depth, strict=True) if x >= deep]
    return RejectionPoint(
        rejection_point=estimate,
        last_clean_users=max(clean) if clean else None,
        plateau=float(running[onset:].mean()),
        saturated_levels=[lv.users for lv in saturated],
        usage_at_rejection=weighted_median(usage[has], weights[has]) if has.any() else None,
        onset_users=saturated[0].users,
        plateau_spread=float(running[onset:].max() - running[onset:].min()),
        uncertainty=half, deep_levels=deep_levels, deep_waiting=deep,
        weights={lv.users: round(float(w), 3) for lv, w in zip(saturated, weights, strict=True)},
        scale=scale, confirmed=len(deep_levels) >= MIN_DEEP_LEVELS, **common,
    )


# The 5% quantile of χ² with 1 to 10 degrees of freedom (the regularized incomplete gamma function's
# root, to four places); beyond, the Wilson-Hilferty approximation, within 0.3% there (`chi2_lower_5`).
_CHI2_LOWER_5 = {1: 0.00393, 2: 0.1026, 3: 0.3518, 4: 0.7107, 5: 1.1455, 6: 1.6354, 7: 2.1673, 8: 2.7326,
                 9: 3.3251, 10: 3.9403}
Z05 = -1.645


def chi2_lower_5(dof: int) -> float:
    """The 5% quantile of the χ² distribution with `dof` degrees of freedom."""
    if dof in _CHI2_LOWER_5:
        return _CHI2_LOWER_5[dof]
    k = 2.0 / (9.0 * dof)
    return dof * (1.0 - k + Z05 * math.sqrt(k)) ** 3


def agreement_scale(chi2: float, dof: int) -> float:
    """The factor the levels' own errors may shrink by when the levels agree better than those errors
    allow: the 95% upper bound of √(true variance / claimed variance) their χ² gives, √(χ² / χ²₅%(dof)),
    at most 1. A level's error is its batch means over ~8 parts of two or three lifetimes, and a preempting
    engine's running swings in a sawtooth about a lifetime long, which makes those parts' means scatter far
    more than the whole window's mean does: eight deep levels of the emulated vLLM at knee~24 read 0.4-1.0
    each and agreed to 0.1 (S = 0.14-0.22, 2026-12-07). Two levels (one degree of freedom) shrink only when
    they agree to within 6% of their errors; three, within 22%; eight, within 55%."""
    if dof < 1:
        return 1.0
    return min(1.0, math.sqrt(chi2 / chi2_lower_5(dof)))


def weighted_plateau(running, weights, errors: list[float | None]):
    """(estimate, ~95% half-width, scale factor) of the level means, each weighted by its depth
    and, where the levels have standard errors, by their inverse variance — a level disturbed
    while it was held (a stall on the client or the engine) scatters and counts for less.

    The variance is propagated from the levels' errors and multiplied by the scale factor
    S = √(χ² / (n − 1)) over the levels weighing at least ½ by depth, when S > 1 — i.e. when they
    scatter more than their errors allow (PDG, "Introduction: averaging measurements"); when they
    agree better than their errors allow, the errors shrink to what the agreement bounds at 95%
    confidence (`agreement_scale`); the half-width never goes below a constant gauge's (SE_FLOOR);
    without per-level errors the weighted scatter alone is used."""
    depth = np.asarray(weights, dtype=float)
    running = np.asarray(running, dtype=float)
    if not (depth > 0).any():  # every saturated level sits at the edge: an unweighted mean, flagged unconfirmed
        depth = np.ones_like(depth)
    se = np.array([np.nan if e is None else float(e) for e in errors], dtype=float)
    near = depth >= 0.5  # an edge level sits below the plateau by design: not read as disagreement
    if np.isfinite(se).all():
        # a level whose gauge did not move in a short window has a tiny error by chance: floor it
        floor = max(SE_FLOOR, 0.25 * float(np.median(se[depth > 0])))
        se = np.maximum(se, floor)
        w = depth / se**2
        total = float(w.sum())
        estimate = float(np.dot(w, running) / total)
        resid = running - estimate
        chi2 = float(np.sum((resid[near] / se[near]) ** 2))
        dof = int(near.sum()) - 1
        scale = math.sqrt(chi2 / dof) if dof >= 1 else None
        # the errors as the levels' scatter bounds them, never below the floor of a constant gauge
        factor = scale if scale is not None and scale > 1.0 else agreement_scale(chi2, dof)
        scaled = np.maximum(se * factor, SE_FLOOR)
        half = Z95 * math.sqrt(float(np.dot(w * w, scaled * scaled))) / total
        return estimate, max(half, Z95 * SE_FLOOR), scale
    total = float(depth.sum())
    estimate = float(np.dot(depth, running) / total)
    dof = total - float(np.dot(depth, depth)) / total  # n - 1 for equal weights
    if dof < 0.5:
        return estimate, None, None
    scatter = float(np.dot(depth, (running - estimate) ** 2)) / dof
    return estimate, Z95 * math.sqrt(scatter * float(np.dot(depth, depth))) / total, None


def deep_levels_to_add(rejection: RejectionPoint, measured: list[int], *, max_users: int | None,
                       precision: float | None = None, wanted: int = TARGET_DEEP_LEVELS) -> list[int]:
    """Levels deep enough that their queue rarely empties, to add until `wanted` deep levels exist
    and the plateau's uncertainty is within `precision` (the tolerance it will be judged with).

    In the fluid limit a closed loop queues (follow × N − C) / follow requests, so a level needs
    N ≥ (C + D × follow) / follow to be deep; the added levels are spaced D apart beyond that and
    beyond every deep level measured so far."""
    if rejection.rejection_point is None or not rejection.follow:
        return []
    missing = wanted - len(rejection.deep_levels)
    if precision is not None and (rejection.uncertainty is None or rejection.uncertainty > precision):
        missing = max(missing, 1)
    if missing <= 0:
        return []
    deep = rejection.deep_waiting
    start = max(rejection.rejection_point / rejection.follow + deep, max(rejection.deep_levels, default=0) + deep)
    out: list[int] = []
    for k in range(4 * wanted):
        n = math.ceil(start + k * deep)
        if max_users is not None and n > max_users:
            break
        if n not in measured and n not in out:
            out.append(n)
        if len(out) == missing:
            break
    return out
