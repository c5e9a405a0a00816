"""Attach to an engine someone else started, end to end against the emulator over real
HTTP with a real Locust subprocess: through run_probe, the console (with and without a YAML file)
and `pytest --kvprobe` (tests/plugin/test_plugin_attach.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from kvprobe.engines import get_dialect
from kvprobe.probe.run import ProbeOptions, open_target, predict, run_probe
from kvprobe.procgroup import free_port
from kvprobe.spec.expectation import load_expectations
from kvprobe.targets.launch import Target
from tests.engine_envs import engine_env

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

@pytest.fixture
def running(tmp_path):
    """`running(engine, flags, env=None)` -> a started emulator (someone else's engine); all stopped after."""
    started = []

    def start(engine: str, flags: dict, env: dict | None = None, model: str = "meta-llama/Llama-3.1-8B"):
        port = free_port()
        argv = get_dialect(engine).emulator_command(model, flags, host="127.0.0.1", port=port)
        target = Target.launch(argv, engine=engine, port=port, log_path=str(tmp_path / f"engine-{port}.log"),
                               startup_timeout=60, env=env)
        started.append(target)
        return target

    yield start
    for target in started:
        target.stop()


def client_bound(check: dict) -> bool:
    """The one verdict a loaded two-core runner may give instead of PASS: Locust could not keep up
    (the probe measures its own client and refuses to judge then)."""
    return check["inconclusive"] and "load generator was the bottleneck" in check["reason"]


STAGING_VLLM = {"served-model-name": "staging-llama", "num-gpu-blocks-override": 201, "max-model-len": 2048,
                "max-num-seqs": 16}


def test_attached_vllm_with_max_num_seqs_16_against_a_file_that_says_256(expectation, running, tmp_path):
    """A misdiagnosis attach must not make: the engine publishes 16 (dev mode /server_info); the probe says
    so before the ramp and predicts from it, so the plateau of 16 is judged against 16."""
    engine = running("vllm", STAGING_VLLM, env={"VLLM_SERVER_DEV_MODE": "1"})
    exp = expectation("emulated-vllm.yaml")
    exp = replace(exp, flags={**exp.flags, "max-num-seqs": 256}, served_model_name="llama")
    lines: list[str] = []
    result = run_probe(exp, ProbeOptions(artifacts_dir=tmp_path / "art", url=engine.url, log=lines.append))
    assert result.error is None, result.error
    first_level = next(i for i, line in enumerate(lines) if line.lstrip().startswith("users"))
    said = [line for line in lines[:first_level] if "CONTRADICTION" in line]
    assert said == ["kvprobe: CONTRADICTION max-num-seqs: the expectation says 256, the engine publishes 16 "
                    "(/server_info)",
                    "kvprobe: CONTRADICTION served model name: the expectation says llama, the engine publishes "
                    "staging-llama (/v1/models)"]
    alone = predict(exp).admission.limit  # 20.32 (20.41 before the ledger's last correction)
    assert any(f"admission limit 16 (max_num_seqs binds); the expectation alone gave {alone:g} (kv)" in line
               for line in lines[:first_level])
    rp = result.check("rejection_point")
    assert rp.binding == "max_num_seqs" and rp.predicted == 16
    assert rp.passed or client_bound(rp.to_dict()), rp.reason
    assert result.check("exactness").passed  # the load sent the engine's served name
    doc = json.loads(Path(result.artifacts["result"]).read_text())
    assert [c["key"] for c in doc["discovery"]["contradictions"]] == ["max-num-seqs", "served model name"]
    assert doc["prediction"]["capacity"]["max_running"] == 16
    assert "max_num_seqs" in (tmp_path / "art" / "ledger.txt").read_text()


def test_console_probe_without_yaml_against_sglang(running, tmp_path):
    """`kvprobe probe --url URL --engine sglang --prompt-tokens P --output-tokens O`: the staging command.
    SGLang publishes every server argument, the pool included; the model's geometry is the preset
    its served id matches; the profile (the shipped `attach` one, in one Locust process here: two
    starve the emulator on a two-core runner) holds each level 3 calibrated lifetimes."""
    engine = running("sglang", {"max-total-tokens": 3300, "context-length": 2048, "max-running-requests": 12,
                                "served-model-name": "Qwen/Qwen3-8B"}, model="/models/qwen3-8b")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    profile = tmp_path / "attach1.yaml"
    profile.write_text((REPO / "kvprobe" / "loadprofiles" / "attach.yaml").read_text()
                       .replace("processes: 2", "processes: 1").replace("drain_seconds: 30", "drain_seconds: 10"))
    proc = subprocess.run([sys.executable, "-m", "kvprobe", "probe", "--url", engine.url, "--engine", "sglang",
                           "--prompt-tokens", "128", "--output-tokens", "32", "--artifacts", str(tmp_path / "art"),
                           "--profile", str(profile), "--tolerance", "rejection_point=1.5"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=400)
    out = proc.stdout
    doc = json.loads((tmp_path / "art" / "result.json").read_text())
    rp = next(c for c in doc["checks"] if c["name"] == "rejection_point")
    assert proc.returncode == (1 if client_bound(rp) else 0), out[-3000:] + proc.stderr[-2000:]
    assert all(c["passed"] for c in doc["checks"] if c["name"] != "rejection_point")
    assert out.startswith("capacity ledger: sglang 0.5.23")  # the engine's own configuration, before the probe
    assert "preset Qwen/Qwen3-8B" in out and "binding limit: max_running_requests" in out
    assert "median of" in out and "published by the engine:" in out
    assert doc["expectation"]["flags"]["max-running-requests"] == 12
    assert doc["expectation"]["name"] == "attach-sglang-Qwen3-8B"
    assert doc["discovery"]["contradictions"] == []
    assert rp["binding"] == "max_running_requests" and rp["predicted"] == 12
    assert rp["passed"] or client_bound(rp), rp["reason"]


def test_console_without_a_matching_preset_asks_for_model_config(running, tmp_path):
    engine = running("vllm", {"num-gpu-blocks-override": 201, "max-model-len": 2048}, model="acme/Private-13B")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    base = [sys.executable, "-m", "kvprobe", "probe", "--url", engine.url, "--engine", "vllm",
            "--prompt-tokens", "128", "--output-tokens", "32"]
    proc = subprocess.run(base, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert (proc.stderr.count("\n") == 1
            and "--model-config: expected a served model kvprobe has a preset for" in proc.stderr)
    assert "the engine serves 'acme/Private-13B'" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "kvprobe", "probe", "--engine", "vllm", "--prompt-tokens", "1"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 2 and "expected an expectation file, or --url, --output-tokens" in proc.stderr


def test_model_config_gives_the_geometry(running, tmp_path, monkeypatch):
    from argparse import Namespace

    from kvprobe.cli.probe import expectation_from_engine

    engine = running("vllm", {"num-gpu-blocks-override": 201, "max-model-len": 2048}, model="acme/Private-13B")
    config = tmp_path / "private" / "config.json"
    config.parent.mkdir()
    config.write_text((REPO / "kvprobe" / "theory" / "model" / "configs" / "llama-3.1-8b.json").read_text())
    args = Namespace(url=engine.url, engine="vllm", prompt_tokens=128, output_tokens=32, model=None,
                     model_config=str(config.parent), engine_version=None, policy=None, gpu_memory=None,
                     api_key_env=None, profile=None)
    exp = expectation_from_engine(args)
    assert (exp.served_model_name, exp.model_config) == ("acme/Private-13B", str(config.parent))
    assert exp.flags["num-gpu-blocks-override"] == 201 and exp.version == "0.33.0"
    from kvprobe.probe.run import predict

    assert predict(exp).capacity.num_blocks == 201


def test_launch_gives_the_model_path_and_the_served_name(expectation, tmp_path):
    exp = replace(expectation("emulated-sglang.yaml"), model="meta-llama/Llama-3.1-8B", served_model_name="llama-8b")
    with open_target(exp, ProbeOptions(artifacts_dir=tmp_path), tmp_path) as target:
        rep = target.facts().reported
    assert (rep.model_path, rep.served_model_name) == ("meta-llama/Llama-3.1-8B", "llama-8b")


def test_a_launched_real_vllm_refuses_an_unknown_flag_in_its_own_words(tmp_path, monkeypatch, pytestconfig):
    """`launch: engine` passes a flag kvprobe does not know to the engine; the engine's own refusal
    heads the error. Real `vllm serve` 0.33.0 (the CPU install kvprobe's shadow target uses)."""
    env = engine_env("vllm", "0.33.0", pytestconfig)  # installed when missing, never skipped
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")  # DeviceConfig is built while vLLM makes its parser
    doc = yaml.safe_load((REPO / "expectations" / "emulated-vllm.yaml").read_text())
    doc.update(name="bogus", profile="short", target={"launch": "engine", "command": [str(env.bin("vllm")), "serve"],
                                                      "startup_timeout": 120})
    doc["flags"]["bogus-flag"] = 3
    path = tmp_path / "bogus.yaml"
    path.write_text(yaml.safe_dump(doc))
    (exp,) = load_expectations(path)
    result = run_probe(exp, ProbeOptions(artifacts_dir=tmp_path / "art"))
    assert result.error is not None
    assert "during start-up" in result.error
    assert result.error.split(" (engine log:")[0].endswith(
        "the engine refused: vllm: error: unrecognized arguments: --bogus-flag 3")
