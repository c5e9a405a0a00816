"""The engine environments the real-scheduler checks run in (tests/theory/test_real_*.py)."""

from __future__ import annotations

import json

import pytest

from kvprobe.errors import ConfigError
from kvprobe.shadow import envs


def engine_env(engine: str, version: str) -> envs.EngineEnv:
    """The engine's environment, installed when missing (`envs.ensure`). One that holds this engine
    version but was built from another pin list (a recipe digest other than this checkout's) is
    used as found: these checks need the engine's scheduler code of that version, not the exact
    pins of its server dependencies, and rebuilding would pull it from under whoever built it."""
    try:
        env = envs.find(engine, version)
    except ConfigError:  # no recipe in this checkout: only an environment as found can serve
        env = None
    if env is not None:
        return env
    env = envs.env_for(engine, version)
    try:
        mark = json.loads((env.root / envs.MARKER).read_text())
    except (OSError, ValueError):
        mark = None
    if mark and mark.get("engine_version") == version and env.python.exists():
        return env
    return envs.ensure(engine, version, log=print)


@pytest.fixture(scope="session")
def vllm_env() -> envs.EngineEnv:
    return engine_env("vllm", "0.33.0")


@pytest.fixture(scope="session")
def sglang_env() -> envs.EngineEnv:
    return engine_env("sglang", "0.5.23")
