"""`--engine sglang` pointed at a vLLM server (or the reverse): kvprobe says which engine the server
looks like, from the engine's own signs, and stops (exit 2). Against both of kvprobe's emulators,
which publish what the engines publish (/metrics families, /v1/models, /server_info, /version)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.cli.console import FLAGS, bare, run
from tests.emulator.conftest import FAST, Served

OTHER = {"vllm": "sglang", "sglang": "vllm"}
SIGNS = {"vllm": "/metrics has vllm: families; /v1/models says owned_by 'vllm'; /version answers (vLLM's)",
         "sglang": "/metrics has sglang: families; /v1/models says owned_by 'sglang'; /server_info answers "
                   "(SGLang's server info)"}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["vllm", "sglang"])
def server(request):
    from kvprobe.targets.emulator.app import Settings

    served = Served(Settings(engine=request.param, model="test/model", flags=FLAGS[request.param], time_model=FAST))
    yield request.param, served
    served.stop()


def test_the_other_engine_is_named_and_the_probe_stops(capsys, server):
    engine, served = server
    rc, out, err = run(capsys, *bare(OTHER[engine], served.url))
    assert rc == 2 and out == ""
    assert err.splitlines() == [f"kvprobe probe: error: --engine: the server at {served.url} looks like {engine}, "
                                f"not {OTHER[engine]} ({SIGNS[engine]}): probe it with --engine {engine}"]


def test_the_engine_named_goes_on_to_discovery(capsys, server):
    engine, served = server
    rc, _, err = run(capsys, *bare(engine, served.url))
    assert rc == 2  # the served id has no preset: discovery read the engine, and asks for the geometry
    assert err.startswith("kvprobe probe: error: --model-config: expected a served model kvprobe has a preset for")


def test_an_expectation_naming_the_other_engine(capsys, server, tmp_path):
    engine, served = server
    exp = yaml.safe_load((REPO / "expectations" / f"emulated-{OTHER[engine]}.yaml").read_text())
    exp["target"] = {"url": served.url}
    path = tmp_path / "attached.yaml"
    path.write_text(yaml.safe_dump(exp))
    rc, out, err = run(capsys, "probe", str(path))
    assert rc == 2 and out == ""
    assert err.splitlines() == [f"kvprobe probe: error: {path}: engine: the server at {served.url} looks like "
                                f"{engine}, not {OTHER[engine]} ({SIGNS[engine]}): write `engine: {engine}`"]
