"""How a shadow target is started: one request, one engine-specific command builder per engine.

`ShadowLaunch` is everything a shadow start needs, independent of where it came from (an
expectation's `target: {launch: shadow}` or `kvprobe shadow ENGINE ...` on the console). Each engine
has a module `kvprobe.targets.shadow.<engine>_target` with `command(req, env) -> (argv, environ)`: the real
server's command line from the engine environment, and the environment variables its processes
need (the dialect's SHADOW_ENV, the time model, the pool sizing inputs). The launcher then starts it
like any engine, in its own process group.
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass, field
from pathlib import Path

import kvprobe
from kvprobe.targets.shadow import envs
from kvprobe.theory.sim.steptime import TimeModel

# Environment variables read inside the engine's processes by kvprobe's worker/plugin.
ENV_ACTIVE = "KVPROBE_SHADOW"  # "1": the shadow worker/plugin may act (never set on a GPU install)
ENV_TIME_MODEL = "KVPROBE_SHADOW_TIME_MODEL"  # TimeModel.encode()


@dataclass(frozen=True)
class ShadowLaunch:
    engine: str
    version: str
    model: str  # the theory's model: a preset id or a config.json path
    config: dict  # that model's config.json as kvprobe's theory read it
    served_model_name: str  # the name clients send; the preset id unless the expectation says otherwise
    flags: dict[str, object]  # the engine's own flags, as an expectation writes them
    host: str = "127.0.0.1"
    port: int = 0
    gpu_memory_bytes: int | None = None  # a declared GPU: sizes the pool when no pool flag is given
    time_model: TimeModel = field(default_factory=TimeModel)
    extra_env: dict[str, str] = field(default_factory=dict)  # target.env
    estimates: dict[str, int] = field(default_factory=dict)  # the expectation's ledger estimates (bytes):
    #                                                          a shadow sizing the pool from a declared GPU uses the same
    engine_args: tuple[str, ...] = ()  # target.engine_args: appended as they are, unseen by the theory


def kvprobe_pythonpath() -> Path:
    """A folder holding only a link to this kvprobe package: on the engine's PYTHONPATH it makes
    kvprobe's worker/plugin importable in the engine's processes (their children inherit it) without
    exposing kvprobe's own site-packages to the engine environment, and without tying the shared
    environment to one checkout of kvprobe."""
    package = Path(kvprobe.__file__).resolve().parent
    folder = envs.cache_root() / "pythonpath" / hashlib.sha256(str(package).encode()).hexdigest()[:12]
    link = folder / "kvprobe"
    if not (link.is_symlink() and link.resolve() == package):
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".kvprobe.{id(folder)}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(package, target_is_directory=True)
        tmp.replace(link)  # atomic: a concurrent launch sees the old or the new link
    return folder


def command(req: ShadowLaunch) -> tuple[list[str], dict[str, str]]:
    """(argv, environment additions) for the shadow server; raises EnvError/ConfigError with one line."""
    env = envs.require(req.engine, req.version)
    module = importlib.import_module(f"kvprobe.targets.shadow.{req.engine}.target")
    argv, environ = module.command(req, env)
    argv += list(req.engine_args)  # last: the engine's own parser has the final word on them
    base = {ENV_ACTIVE: "1", ENV_TIME_MODEL: req.time_model.encode(), **envs.shadow_import_env(req.engine)}
    return argv, {**base, **environ, **req.extra_env}
