"""The one way a test gets a real engine's environment: `recipes.ensure` — installed when missing
(never skipped), keyed by the recipe digest of this checkout (`recipes.env_for`), the install's
progress on the terminal."""

from __future__ import annotations

import pytest

from kvprobe.targets.shadow import envs, recipes


def engine_env(engine: str, version: str, pytestconfig: pytest.Config | None = None) -> envs.EngineEnv:
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter") if pytestconfig is not None else None
    log = reporter.write_line if reporter is not None else (lambda line: print(line, flush=True))
    return recipes.ensure(engine, version, log=log)
