"""What an engine reports about itself (`EngineFacts`), merged from several sources (/metrics, its
info endpoints, its start-up log), each field labelled with where it was read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvprobe.engines.base import ReportedCapacity


@dataclass
class EngineFacts:
    """What the engine says about itself, each field with the place it was read from."""

    engine: str
    version: str | None
    url: str
    reported: ReportedCapacity
    log_path: str | None
    mode: str  # "launch" | "attach"
    # field -> {source: value} where two sources disagree (the winner is in `reported`)
    conflicts: dict[str, dict[str, object]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # sources that could not be read, one line each
    # A shadow target: what kvprobe's worker/plugin inside the engine said at start-up (the scheduler
    # it ran, async scheduling on or off, how the pool was sized); None for any other target.
    shadow: dict | None = None


def _with_sources(rc: ReportedCapacity, where: str) -> ReportedCapacity:
    """Every known field gets a source; ones the dialect did not label are labelled `where`."""
    sources = {}
    for name in rc.__dataclass_fields__:
        if name not in ("sources", "flags") and getattr(rc, name) is not None:
            sources[name] = rc.sources.get(name, where)
    for flag in rc.flags:  # a published flag counts even as None ("not given")
        sources[f"flags.{flag}"] = rc.sources.get(f"flags.{flag}", where)
    values = {n: getattr(rc, n) for n in rc.__dataclass_fields__ if n != "sources"}
    return ReportedCapacity(**values, sources=sources)


def _same(a: object, b: object) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float):
        return abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1.0)
    return a == b


def merge_reports(reports: list[tuple[str, ReportedCapacity]]) -> tuple[ReportedCapacity, dict]:
    """Merge in the given order (earlier wins) and list the fields on which sources disagree."""
    merged = ReportedCapacity()
    seen: dict[str, dict[str, object]] = {}
    for where, rc in reports:
        rc = _with_sources(rc, where)
        merged = merged.merged(rc)
        for name in rc.sources:
            seen.setdefault(name, {})[rc.sources[name]] = rc.value(name)
    conflicts = {}
    for name, by_source in seen.items():
        values = list(by_source.values())
        if any(not _same(values[0], v) for v in values[1:]):
            conflicts[name] = by_source
    return merged, conflicts
