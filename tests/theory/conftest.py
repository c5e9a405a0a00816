"""The engine environments the real-scheduler checks run in (tests/theory/test_real_*.py)."""

from __future__ import annotations

import pytest

from kvprobe.targets.shadow import envs
from tests.engine_envs import engine_env


@pytest.fixture(scope="session")
def vllm_env(pytestconfig) -> envs.EngineEnv:
    return engine_env("vllm", "0.33.0", pytestconfig)


@pytest.fixture(scope="session")
def sglang_env(pytestconfig) -> envs.EngineEnv:
    return engine_env("sglang", "0.5.23", pytestconfig)
