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
    """Start or reach the engine `exp` names (the caller closes it). An engine attached at a URL is
    asked first whether it takes the API key (a 401/403 is said as that) and whether it is the engine
    named (else which one it looks like), before any other read."""
    kind = target_kind(exp, url=how.url)
    if kind is Target:
        url = how.url or exp.target.url
        if url:
            _check_attached(url, exp)
    return kind.open(exp, how)


def _check_attached(url: str, exp) -> None:
    import os

    from kvprobe.engines import get_dialect
    from kvprobe.observe.http import check_access, read_key

    env = exp.target.api_key_env
    api_key = read_key(env, os.environ, key="target.api_key_env") if env else None
    check_access(url, path=get_dialect(exp.engine).MODELS_PATH, api_key=api_key, api_key_env=env,
                 key="target.api_key_env", file=exp.path)
    from kvprobe.observe.discovery import check_engine

    check_engine(url, exp.engine, {"Authorization": f"Bearer {api_key.reveal()}"} if api_key else None,
                 key="engine", file=exp.path)
