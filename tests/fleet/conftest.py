"""Fleet fixtures: the real sglang-router 0.3.2 (its environment installed when missing, never
skipped) in front of emulated vLLM replicas, every process in its own group and stopped after."""

from __future__ import annotations

import pytest

from kvprobe.engines import get_dialect
from kvprobe.procgroup import free_port
from kvprobe.targets.fleet import router as rt
from kvprobe.targets.fleet.target import FleetTarget
from kvprobe.targets.launch import Target

MODEL = "meta-llama/Llama-3.1-8B"


@pytest.fixture(scope="session")
def router_binary():
    from kvprobe.targets.shadow import envs

    return envs.ensure(rt.NAME, rt.VERSION, log=lambda line: None).bin("sglang-router")


def replica_launcher(flags: dict | None = None, extra: list[str] | None = None):
    dialect = get_dialect("vllm")

    def launch(i, log_path):
        port = free_port()
        argv = dialect.emulator_command(MODEL, flags or {"num-gpu-blocks-override": 201, "max-model-len": 2048},
                                        host="127.0.0.1", port=port, extra=extra or ["--step-ms", "20"],
                                        version="0.33.0")
        return Target.launch(argv, engine="vllm", port=port, log_path=str(log_path), startup_timeout=60)

    return launch


@pytest.fixture
def make_fleet(tmp_path, router_binary):
    fleets = []

    def make(replicas: int, policy: str, **kw) -> FleetTarget:
        ft = FleetTarget.launch(engine="vllm", replicas=replicas, policy=policy, artifacts=tmp_path,
                                launch_replica=replica_launcher(**kw), router_binary=router_binary)
        fleets.append(ft)
        return ft

    yield make
    for ft in fleets:
        ft.stop()
