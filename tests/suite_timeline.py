"""Where a run of lanes' wall clock went: from the holds the lanes logged (kvprobe.load.turns.log_hold),
the lines `make test` prints at its end.

The lanes take turns at loading the machine, so the suite's wall clock is bounded below by the time
the load turn was held plus the time one lane ran alone (`needs_a_quiet_machine`); what is left is
engines starting and draining beside another lane's turn. These lines say which bound the run
met, and which modules held the turn longest: where a shorter suite has to come from.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def read_holds(path: Path) -> list[dict]:
    """The holds logged in `path` (none when it does not exist); a torn last line is skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return []
    holds = []
    for line in text.splitlines():
        try:
            holds.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return holds


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of `spans`."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summary(holds: list[dict], wall_seconds: float, *, top: int = 8) -> list[str]:
    """The lines that say where `wall_seconds` went."""
    if not holds or wall_seconds <= 0:
        return []

    def minutes(seconds: float) -> str:
        return f"{seconds / 60:.1f} min"

    turn = [h for h in holds if h["kind"] == "turn"]
    quiet = [h for h in holds if h["kind"] == "quiet"]
    held = covered([(h["start"], h["end"]) for h in turn])
    alone = covered([(h["start"], h["end"]) for h in quiet])
    lines = [f"wall {minutes(wall_seconds)}: the load turn held {minutes(held)} ({held / wall_seconds:.0%}), "
             f"a lane alone (needs_a_quiet_machine) {minutes(alone)}; the rest is engines starting and "
             "draining beside another lane's turn"]
    by_worker: dict[str, list[dict]] = defaultdict(list)
    for h in holds:
        if h["kind"] in ("lane", "quiet"):
            by_worker[h.get("worker") or "?"].append(h)
    waits: dict[str, float] = defaultdict(float)
    for h in turn:
        waits[h.get("worker") or "?"] += h["waited"]
    for worker in sorted(by_worker):
        ran = covered([(h["start"], h["end"]) for h in by_worker[worker]])
        lines.append(f"{worker}: lane tests {minutes(ran)}, of which waiting for the turn {minutes(waits[worker])}")
    per_module: dict[str, float] = defaultdict(float)
    for h in turn:
        per_module[h["who"].split("::", 1)[0]] += h["end"] - h["start"]
    longest = sorted(per_module.items(), key=lambda kv: -kv[1])[:top]
    if longest:
        lines.append("held the turn longest: " + "; ".join(f"{who} {s:.0f} s" for who, s in longest))
    return lines
