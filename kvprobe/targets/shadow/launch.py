"""How a shadow target is started: one request, one engine-specific command builder per engine.

`ShadowLaunch` is everything a shadow start needs, independent of where it came from (an
expectation's `target: {launch: shadow}` or `kvprobe shadow ENGINE ...` on the console). Each engine
has a module `kvprobe.targets.shadow.<engine>.target` (ENGINE_TARGETS) with `command(req, env) ->
(argv, environ)`: the real server's command line from the engine environment, and the environment
variables its processes need (the dialect's SHADOW_ENV, the time model, the pool sizing inputs); and
`parse_worker_log(text) -> dict`: what kvprobe's code inside the engine said at start-up. The
launcher then starts it like any engine, in its own process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvprobe.targets.shadow import envs, recipes
from kvprobe.targets.shadow.settings import ACTIVE_ENV, TIME_MODEL_ENV
from kvprobe.targets.shadow.sglang import target as sglang_target
from kvprobe.targets.shadow.vllm import target as vllm_target
from kvprobe.theory.sim.steptime import TimeModel

ENGINE_TARGETS = {"vllm": vllm_target, "sglang": sglang_target}


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
    gpu_capability: str | None = None  # a named card's compute capability: the kernels vLLM picks by it
    time_model: TimeModel = field(default_factory=TimeModel)
    extra_env: dict[str, str] = field(default_factory=dict)  # target.env
    # the expectation's ledger estimates (bytes): a shadow sizing the pool from a declared GPU uses the same
    estimates: dict[str, int] = field(default_factory=dict)
    engine_args: tuple[str, ...] = ()  # target.engine_args: appended as they are, unseen by the theory


def command(req: ShadowLaunch) -> tuple[list[str], dict[str, str]]:
    """(argv, environment additions) for the shadow server; raises EnvError/ConfigError with one line."""
    env = recipes.require(req.engine, req.version)
    argv, environ = ENGINE_TARGETS[req.engine].command(req, env)
    argv += list(req.engine_args)  # last: the engine's own parser has the final word on them
    base = {ACTIVE_ENV: "1", TIME_MODEL_ENV: req.time_model.encode(), **envs.shadow_import_env(req.engine)}
    return argv, {**base, **environ, **req.extra_env}
