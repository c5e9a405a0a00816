"""What changed between two releases' figures (`kvprobe.probe.diff.release_figures`): each figure `kvprobe diff`
compares (`QUANTITIES`, as `expect_change:` names them), when a move counts as a change, and whether the
ledger's own figure, under each release's rules, moved the same way (explained, and by which rule:
`kvprobe.probe.diff_explain`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

from kvprobe.probe.diff_explain import explanation
from kvprobe.spec.schema import CHANGE_KEYS

UNEXPLAINED = "unexplained: the theory has no rule for this change"


def release_groups(runs: list[str], repeat: int = 1) -> list[list[str]]:
    """The runs of each release: `repeat` consecutive runs each (`kvprobe diff --repeat`), in order."""
    if repeat < 1 or len(runs) % repeat:
        raise ValueError(f"{len(runs)} runs do not split into releases of {repeat} runs each")
    return [runs[i:i + repeat] for i in range(0, len(runs), repeat)]


def find_changes(runs: list[str], results: dict[str, dict], tol, *, repeat: int = 1) -> list[dict]:
    """Between consecutive releases: each figure that moved beyond tolerance, explained or not. A release
    run `repeat` times changed a figure only when every run of it shows the move against every run of
    the next: a move the runs of one release make among themselves (`find_noise`) is not the release's."""
    changes = []
    groups = release_groups(runs, repeat)
    for ga, gb in zip(groups, groups[1:], strict=False):
        for quantity in QUANTITIES:
            moves = {(a, b): quantity.moved(results[a], results[b], tol) for a in ga for b in gb}
            pairs = [ab for ab, moved in moves.items() if moved is not None]  # both runs measured it
            if not pairs or not all(moves[ab] for ab in pairs):
                continue
            a, b = min(pairs, key=lambda ab: quantity.distance(results[ab[0]], results[ab[1]]))
            ra, rb = results[a], results[b]
            explained = quantity.ledger_moved(ra, rb, tol)
            change = {"from": ga[0], "to": gb[0], "quantity": quantity.name, "key": quantity.key,
                      "measured": [quantity.measured(ra), quantity.measured(rb)],
                      "ledger": [quantity.ledger(ra), quantity.ledger(rb)],
                      "policies": [ra["policy"], rb["policy"]], "explained": bool(explained),
                      "explanation": explanation(ra, rb, quantity.key, tol) if explained else UNEXPLAINED}
            if repeat > 1:  # every run's figure; `measured` is the closest pair's
                change["runs"] = [[quantity.measured(results[r]) for r in g] for g in (ga, gb)]
            changes.append(change)
    return changes


def find_noise(runs: list[str], results: dict[str, dict], tol, *, repeat: int = 1) -> list[dict]:
    """Within each release run more than once: each figure that moved beyond tolerance from one of its runs
    to another. The same code on the same shape, so the move is the run-to-run spread of the measurement
    (a preempting shape settling into another regime), the floor below which no release change can be told."""
    noise = []
    for group in release_groups(runs, repeat):
        for quantity in QUANTITIES:
            if any(quantity.moved(results[a], results[b], tol) for a, b in combinations(group, 2)):
                noise.append({"release": group[0], "runs": list(group), "quantity": quantity.name,
                              "key": quantity.key, "measured": [quantity.measured(results[r]) for r in group]})
    return noise


@dataclass(frozen=True)
class Quantity:
    """One figure the diff compares: the measured one and the ledger's (fields of a release's
    figures), and when a move counts: a "state" on any difference (after `state`), a "number"
    beyond an allowance (and beyond both measurements' uncertainties, `spread`)."""

    key: str  # as `expect_change:` names it (kvprobe.spec.schema.CHANGE_KEYS)
    name: str
    field: str
    ledger_field: str
    kind: str = "number"
    state: Callable[[object], object] = lambda x: x
    allowance: Callable[[object, float, float], float] = lambda tol, a, b: 0.0
    spread: Callable[[dict, dict], float] = lambda ra, rb: 0.0
    # a "state" read from another field than the one shown (the preemptions' presence: from the
    # count, known even where the streams could not time a step for the rate)
    state_field: str | None = None
    # a "state" that differs counts when this says the measurements differ beyond chance, or when the ledger's
    # figure changes to the same new state (the theory predicted it: few events then suffice)
    significant: Callable[[dict, dict], bool] = lambda ra, rb: True
    # the factor by which the figure moves when only other figures do (the capacity line follows its
    # pool), measured (False) or the ledger's (True); None: it does not
    follows: Callable[[dict, dict, bool], float] | None = None

    def measured(self, r: dict):
        return r.get(self.field)

    def _state_source(self, r: dict):
        return r.get(self.state_field) if self.state_field else self.measured(r)

    def ledger(self, r: dict):
        return r.get(self.ledger_field)

    def moved(self, ra: dict, rb: dict, tol) -> bool | None:
        if self.kind == "state":
            sa, sb = self.state(self._state_source(ra)), self.state(self._state_source(rb))
            if sa is None or sb is None:
                return None
            return sa != sb and (self.significant(ra, rb) or self.ledger_moved(ra, rb, tol))
        a, b = self.measured(ra), self.measured(rb)
        if a is None or b is None:
            return None
        base = a if self.follows is None else a * self.follows(ra, rb, False)
        return abs(b - base) - self.spread(ra, rb) > self.allowance(tol, base, b) + 1e-9

    def distance(self, ra: dict, rb: dict) -> float:
        """How far two runs' figures lie apart (a "state" that differs: no distance to rank)."""
        a, b = self.measured(ra), self.measured(rb)
        return abs(b - a) if self.kind == "number" and a is not None and b is not None else 0.0

    def ledger_moved(self, ra: dict, rb: dict, tol) -> bool:
        """The ledger's figure moved as the measurement did: to the same new state, or the same
        direction beyond the same allowance."""
        la, lb = self.ledger(ra), self.ledger(rb)
        if la is None or lb is None:
            return False
        if self.kind == "state":
            return self.state(la) != self.state(lb) and self.state(lb) == self.state(self._state_source(rb))
        a, b = self.measured(ra), self.measured(rb)
        if self.follows is not None:  # the moves beyond what the pools' moves make of each
            a, la = a * self.follows(ra, rb, False), la * self.follows(ra, rb, True)
        return (lb - la) * (b - a) > 0 and abs(lb - la) > self.allowance(tol, la, lb) + 1e-9


def _preempts(count) -> str | None:
    return None if count is None else ("preempts" if count > 0 else "none")


SIGNIFICANCE = 0.05  # the chance one shared rate leaves for the counts seen, below which they differ


def preemptions_differ(ra: dict, rb: dict) -> bool:
    """Do two releases preempt at different rates beyond chance? A saturated engine may preempt now and then
    whatever its release (one event a deep level where the ledger predicts none, docs/diff.md): under one
    shared rate, the preemptions of both runs fall to each in proportion to its exposure (the deep levels'
    engine steps, or their number where a run could not time its steps), so the larger side's count is
    binomial; it differs when at least that many would fall to it with chance below SIGNIFICANCE. No
    preemption against five over equal exposure differs (0.5^5 = 0.031), against four or fewer it does not
    — unless the ledger predicts the change (Quantity.moved): SGLang 0.5.21's emulator retracts 1-2.5 times a
    deep level where 0.5.23's never does, the rule the ledger has."""
    counts = [r["preemptions_per_deep_level"] * len(r["deep_levels"]) for r in (ra, rb)]
    steps = [r.get("deep_level_steps") for r in (ra, rb)]
    exposure = steps if None not in steps else [len(r["deep_levels"]) for r in (ra, rb)]
    total, big = round(sum(counts)), max((0, 1), key=lambda i: counts[i] / exposure[i])
    share = exposure[big] / sum(exposure)
    k = round(counts[big])
    tail = sum(math.comb(total, j) * share**j * (1 - share) ** (total - j) for j in range(k, total + 1))
    return tail < SIGNIFICANCE


def _binding(limit: str | None) -> str | None:
    """The limit that stops admission, as the ledger names it: the diagnosis's `pool` (KV fills below
    what the reported pool allows) is still the KV pool binding; `unknown` says nothing."""
    return {"pool": "kv", "unknown": None}.get(limit, limit) if limit is not None else None


def _pool_ratio(ra: dict, rb: dict, ledger: bool) -> float:
    """How the pool moved (measured, or the ledger's): the capacity line moves with it (vLLM's line is
    the pool over each request's blocks, times the length) without a change of its own."""
    key = "ledger_pool" if ledger else "pool"
    pa, pb = ra.get(key), rb.get(key)
    return pb / pa if pa and pb else 1.0


QUANTITIES = (
    Quantity("startup", "startup", "startup", "ledger_startup", "state",
             state=lambda x: "started" if x in ("started", "starts") else x),
    Quantity("pool", "pool", "pool", "ledger_pool",
             allowance=lambda tol, a, b: tol.reported_capacity * max(abs(a), abs(b))),
    Quantity("rejection_point", "rejection point", "rejection_point", "predicted",
             allowance=lambda tol, a, b: max(tol.rejection_point, tol.rejection_point_relative * max(abs(a), abs(b))),
             # beyond the tolerance even allowing for both uncertainties: a move the noise cannot make
             spread=lambda ra, rb: math.hypot(ra["uncertainty"] or 0.0, rb["uncertainty"] or 0.0)),
    # whether deep levels preempt at all, shown per 1k engine steps on both sides (the ledger's unit;
    # the count per deep level, beside it in the table, follows the hold)
    Quantity("preemptions", "preemptions per 1k steps", "preemptions_per_1k_steps", "ledger_preemption_rate",
             "state", state=_preempts, state_field="preemptions_per_deep_level", significant=preemptions_differ),
    Quantity("usage", "usage at saturation", "usage_at_saturation", "predicted_usage",
             allowance=lambda tol, a, b: tol.usage_gap),
    Quantity("binding", "binding limit", "binding", "predicted_binding", "state", state=_binding),
    # the engine's own "GPU KV cache size" beyond what its pool's move makes of it: what a release
    # changed in the line's semantics (vLLM's blocks a request of each KV cache group is counted for)
    Quantity("capacity_line", "engine's capacity line (tokens)", "claim_tokens", "ledger_claim_tokens",
             allowance=lambda tol, a, b: tol.reported_capacity * max(abs(a), abs(b)), follows=_pool_ratio),
)

assert tuple(q.key for q in QUANTITIES) == CHANGE_KEYS, "expect_change: names every figure the diff compares"
