"""`target: {launch: shadow}`: an expectation's shadow start, through the launcher that starts every
engine (its own process group, the health deadline, the log tail on a failed start).

The engine-specific part is `kvprobe.targets.shadow.<engine>.target`: `command(req, env)` builds the real
server's command line, and an optional `parse_worker_log(text) -> dict` reads what kvprobe's
worker/plugin said at start-up, which the probe records in its engine facts.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

from kvprobe.procgroup import free_port
from kvprobe.targets.facts import EngineFacts
from kvprobe.targets.interface import OpenHow
from kvprobe.targets.launch import Target
from kvprobe.targets.shadow import launch
from kvprobe.theory.model.geometry import load_model_config
from kvprobe.theory.sim.steptime import TimeModel

_MAX_LOG_READ = 4 * 2**20


def launch_request(exp, *, port: int, host: str = "127.0.0.1") -> launch.ShadowLaunch:
    """The shadow start an expectation describes."""
    config, _ = load_model_config(exp.model_config or exp.model, base_dir=exp.model_base_dir)
    return launch.ShadowLaunch(
        engine=exp.engine, version=exp.version, model=exp.model, config=config,
        served_model_name=exp.served_name, flags=dict(exp.flags), host=host, port=port,
        gpu_memory_bytes=exp.hardware.gpu_memory_bytes, gpu_capability=exp.hardware.capability,
        time_model=TimeModel(**exp.target.time_model),
        extra_env=dict(exp.target.env), estimates=dict(exp.estimates), engine_args=tuple(exp.target.engine_args))


class ShadowTarget(Target):
    """A launched shadow engine: its facts also carry what kvprobe's code inside the engine said.

    Its processes keep their temporary files in a folder of their own (TMPDIR, unless the expectation's
    `target.env` names one), removed once the group is gone: SGLang 0.5.23 names its ZMQ sockets after
    files it never deletes (`tempfile.NamedTemporaryFile(delete=False)`, srt/server_args.py PortArgs,
    five a start), and vLLM 0.33.0 puts its sockets (`VLLM_RPC_BASE_PATH`, the temporary folder by
    default: envs.py) and its Prometheus multiprocess folder (v1/metrics/prometheus.py) there, which a
    stopped group leaves behind: a suite's shadow servers left hundreds of files in /tmp."""

    scratch: str | None = None  # the processes' TMPDIR while they run

    @classmethod
    def launch(cls, argv: list[str], *, env: dict[str, str] | None = None, **kwargs) -> ShadowTarget:
        env = dict(env or {})
        if "TMPDIR" in env:
            return super().launch(argv, env=env, **kwargs)
        scratch = tempfile.mkdtemp(prefix="kvprobe-shadow-")
        try:
            target = super().launch(argv, env={**env, "TMPDIR": scratch}, **kwargs)
        except BaseException:  # the launcher stopped the group before it raised
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        target.scratch = scratch
        # a target never stopped (the launcher's finalizer stops its group) leaves no folder either
        target._remove_scratch = weakref.finalize(target, shutil.rmtree, scratch, True)
        return target

    def stop(self, grace: float = 10) -> int | None:
        code = super().stop(grace)  # survivors raise: their folder stays with them
        if self.scratch is not None:
            self._remove_scratch()
        return code

    @classmethod
    def open(cls, exp, how: OpenHow) -> ShadowTarget:
        """The shadow server for `exp` on `target.port` (else a free one), logging to the artifacts."""
        return open_shadow(exp, port=exp.target.port or free_port(), log_path=how.artifacts / "engine.log")

    def facts(self, *, refresh: bool = False, timeout: float = 5.0) -> EngineFacts:
        facts = super().facts(refresh=refresh, timeout=timeout)
        if facts.shadow is None:
            facts.shadow = worker_report(self.engine, self.log_path)
        return facts


def worker_report(engine: str, log_path: str | None) -> dict:
    module = launch.ENGINE_TARGETS[engine]
    parse = getattr(module, "parse_worker_log", None)
    if parse is None or not log_path:
        return {}
    try:
        with open(log_path, "rb") as fh:
            return parse(fh.read(_MAX_LOG_READ).decode("utf-8", "replace"))
    except OSError:
        return {}


def open_shadow(exp, *, port: int, log_path: Path) -> ShadowTarget:
    """Start the shadow server for `exp` and wait until it is healthy (EnvError/ConfigError/TargetError
    with one line, and the log tail for a failed start)."""
    argv, environ = launch.command(launch_request(exp, port=port))
    return ShadowTarget.launch(argv, engine=exp.engine, port=port, log_path=str(log_path),
                               startup_timeout=exp.target.startup_timeout, env=environ)
