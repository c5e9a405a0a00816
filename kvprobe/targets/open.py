"""The one place that reads which kind of target an expectation names: a fleet, an engine attached
at a URL, a shadow engine, or a launched emulator or engine (kvprobe.targets.interface)."""

from __future__ import annotations

from kvprobe.errors import ConfigError
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
            check_attached(url, exp.engine, exp.target.api_key_env, file=exp.path)
    return kind.open(exp, how)


def check_attached(url: str, engine: str, api_key_env: str | None, *, file: str | None = None,
                   key_option: str = "target.api_key_env", engine_option: str = "engine") -> None:
    """Before anything reads an attached engine: the API key's variable is set, the engine takes the
    key (a 401/403 names the key and `key_option`, not a missing model or a start-up refusal later),
    and the server is `engine` (else which one it looks like, `engine_option` to change). Bad input,
    exit 2; a server that does not answer is left to the attach, which says why."""
    import os

    from kvprobe.engines import get_dialect
    from kvprobe.observe.client import check_access
    from kvprobe.observe.discovery import check_engine
    from kvprobe.observe.http import read_key

    try:
        api_key = read_key(api_key_env, os.environ, key=key_option) if api_key_env else None
    except ConfigError as err:
        raise (ConfigError(str(err), file=file) if file else err) from None
    if check_access(url, path=get_dialect(engine).MODELS_PATH, api_key=api_key, api_key_env=api_key_env,
                    key=key_option, file=file):
        check_engine(url, engine, {"Authorization": f"Bearer {api_key.reveal()}"} if api_key else None,
                     key=engine_option, file=file)
