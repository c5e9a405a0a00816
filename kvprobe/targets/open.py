"""The one place that reads which kind of target an expectation names: a fleet, an engine attached
at a URL, a shadow engine, or a launched emulator or engine (kvprobe.targets.interface)."""

from __future__ import annotations

from kvprobe.targets.fleet.target import FleetTarget
from kvprobe.targets.interface import OpenHow, ProbeTarget
from kvprobe.targets.launch import Target
from kvprobe.targets.shadow.target import ShadowTarget


def target_kind(exp, *, url: str | None = None) -> type:
    """The class of target `exp` opens (a URL given by the caller attaches a single engine there;
    a fleet attaches as its own spec says)."""
    if exp.target.fleet:
        return FleetTarget
    if url or exp.target.url:
        return Target
    if exp.target.mode == "shadow":
        return ShadowTarget
    return Target


def open_target(exp, how: OpenHow) -> ProbeTarget:
    """Start or reach the engine `exp` names (the caller closes it)."""
    return target_kind(exp, url=how.url).open(exp, how)
