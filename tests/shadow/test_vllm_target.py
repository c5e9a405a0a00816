"""The vLLM shadow target's command line and environment, the worker's settings and its log lines,
the console's flag parsing — no server started (the model folder is built with the engine env)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvprobe
from kvprobe.cli import shadow_vllm as vllm_cli
from kvprobe.errors import ConfigError
from kvprobe.targets.shadow import launch
from kvprobe.targets.shadow.settings import ENV_SETTINGS, WORKER_CLS, WorkerSettings, parse_worker_lines
from kvprobe.targets.shadow.vllm import target as vllm_target
from kvprobe.theory.model.geometry import load_model_config

LLAMA = "meta-llama/Llama-3.1-8B"


def request(flags: dict, **kw) -> launch.ShadowLaunch:
    config, _ = load_model_config(kw.pop("model", LLAMA))
    return launch.ShadowLaunch(engine="vllm", version="0.33.0", model=LLAMA, config=config,
                               served_model_name=kw.pop("served", LLAMA), flags=flags, port=8123, **kw)


def arg(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.slow
def test_command_is_vllm_serve_from_the_env_with_the_worker(vllm_env, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    req = request({"num-gpu-blocks-override": 1000, "block-size": 16, "max-model-len": 4096,
                   "async-scheduling": False, "enable-prefix-caching": False},
                  served="llama", extra_env={"OMP_NUM_THREADS": "1"})
    argv, env = launch.command(req)
    assert argv[:2] == [str(vllm_env.bin("vllm")), "serve"]
    folder = Path(argv[2])
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert arg(argv, "--worker-cls") == WORKER_CLS and arg(argv, "--served-model-name") == "llama"
    assert (arg(argv, "--host"), arg(argv, "--port")) == ("127.0.0.1", "8123")
    assert arg(argv, "--num-gpu-blocks-override") == "1000" and "--no-enable-prefix-caching" in argv
    # the GPU's batch defaults for an undeclared GPU (< 70 GiB tier), which the CPU platform would not pick
    assert (arg(argv, "--max-num-seqs"), arg(argv, "--max-num-batched-tokens")) == ("256", "2048")
    settings = WorkerSettings.decode(env[ENV_SETTINGS])
    assert settings == WorkerSettings(async_scheduling=False, block_size=16, chunked_prefill=True,
                                      prefix_caching=False, max_num_batched_tokens=2048)
    assert env["KVPROBE_SHADOW"] == "1" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "1"
    # PYTHONPATH holds only a link to this kvprobe package
    path = Path(env["PYTHONPATH"])
    assert [p.name for p in path.iterdir()] == ["kvprobe"]
    assert (path / "kvprobe").resolve() == Path(kvprobe.__file__).resolve().parent


def test_gpu_batch_defaults_follow_the_declared_gpu():
    config, _ = load_model_config(LLAMA)
    assert vllm_target.gpu_batch_flags(config, {"max-model-len": 8192}, 80 * 2**30) == \
        {"max-num-seqs": 1024, "max-num-batched-tokens": 8192}
    assert vllm_target.gpu_batch_flags(config, {"max-num-seqs": 16}, None) == {"max-num-batched-tokens": 2048}
    assert vllm_target.gpu_batch_flags(config, {"max-num-seqs": 8, "max-num-batched-tokens": 512}, None) == {}


@pytest.mark.parametrize(("flags", "gpu", "environ", "match"), [
    ({}, None, {}, r"no GPU to profile: declare hardware\.gpu_memory"),
    ({"num-gpu-blocks-override": 9, "tensor-parallel-size": 2}, None, {}, "tensor-parallel-size must be 1, got 2"),
    ({"kv-cache-memory-bytes": 2**30}, None, {"VLLM_CPU_KVCACHE_SPACE": "4"}, "unset VLLM_CPU_KVCACHE_SPACE"),
])
def test_refusals_before_anything_starts(flags, gpu, environ, match):
    with pytest.raises(ConfigError, match=match):
        vllm_target.check_request(flags, gpu, environ)


def test_settings_round_trip_and_refuse_unknown_keys():
    s = WorkerSettings(async_scheduling=False, block_size=64, gpu_memory_bytes=80 * 2**30,
                       estimates={"other_bytes": 1})
    assert WorkerSettings.decode(s.encode()) == s
    assert WorkerSettings.decode("") == WorkerSettings()
    with pytest.raises(ValueError, match="unknown setting"):
        WorkerSettings.decode(json.dumps({"asynch": True}))


def test_worker_lines_are_read_back_from_the_engine_log():
    log = """(EngineCore pid=1) INFO 12-01 10:58:16 [vllm_worker.py:269] kvprobe shadow worker: restored what the \
CPU platform changed and a CUDA GPU keeps: async_scheduling False -> True; enable_chunked_prefill False -> True
(EngineCore pid=1) INFO 12-01 10:58:16 [vllm_worker.py:166] kvprobe shadow worker: KV memory from declared GPU: \
5923602432 bytes (requested ...)
(EngineCore pid=1) INFO 12-01 10:58:16 [vllm_worker.py:171] kvprobe shadow worker: scheduler AsyncScheduler \
(async_scheduling=True), num_blocks=2759, block_size=16, time model step_ms=5.0"""
    assert parse_worker_lines(log) == {
        "restored": ["async_scheduling False -> True", "enable_chunked_prefill False -> True"],
        "kv_memory_source": "declared GPU", "kv_memory_bytes": 5923602432, "scheduler": "AsyncScheduler",
        "async_scheduling": True, "num_blocks": 2759, "block_size": 16}
    assert parse_worker_lines("no worker here") == {}


def test_console_flags_are_typed_like_an_expectations():
    flags = vllm_cli.flags_from_argv(["--num-gpu-blocks-override", "1000", "--max-model-len=4096",
                                      "--no-enable-prefix-caching", "--enforce-eager", "--kv-cache-memory-bytes",
                                      "4GiB", "--served-model-name", "x", "--scheduling-policy", "priority"])
    assert flags == {"num-gpu-blocks-override": 1000, "max-model-len": 4096, "enable-prefix-caching": False,
                     "enforce-eager": True, "kv-cache-memory-bytes": 4 * 2**30, "served-model-name": "x",
                     "scheduling-policy": "priority"}
    with pytest.raises(ConfigError, match="max-num-seqs"):
        vllm_cli.flags_from_argv(["--max-num-seqs", "lots"])
    with pytest.raises(ConfigError, match="expected a vLLM flag"):
        vllm_cli.flags_from_argv(["serve"])


@pytest.mark.parametrize(("version", "named"), [("0.19.1", False), ("0.20.2", True), ("0.21.0", True),
                                                ("0.22.1", True), ("0.23.0", False), ("0.33.0", False)])
def test_the_uni_executor_is_named_by_its_class_where_the_cpu_platform_would_rewrite_it(version, named):
    # 0.20.2-0.22.1's platforms/cpu.py turns `uni` into `mp` unconditionally (target.UNI_REWRITTEN)
    flags = vllm_target.executor_flags(version)
    assert flags == (["--distributed-executor-backend", vllm_target.UNI_EXECUTOR] if named else [])


@pytest.mark.parametrize(("model", "version", "given"), [
    ("deepseek-ai/DeepSeek-V3", "0.18.1", 64), ("deepseek-ai/DeepSeek-V3", "0.22.1", 64),
    ("deepseek-ai/DeepSeek-V3", "0.23.0", None), (LLAMA, "0.18.1", None)])
def test_an_mla_model_gets_the_gpus_block_size_where_the_api_server_would_publish_the_cpus(model, version, given):
    # through 0.22.1 the API server never takes EngineCore's block size (target.BLOCK_SIZE_SYNC_FROM)
    config, _ = load_model_config(model)
    flags = vllm_target.published_block_flags(config, {}, version)
    assert flags == ({"block-size": given} if given else {})
    assert vllm_target.published_block_flags(config, {"block-size": 16}, version) == {}


@pytest.mark.parametrize(("version", "env"), [("0.18.1", {}), ("0.33.0", {}), ("0.34.0", {"CUDA_VISIBLE_DEVICES": ""})])
def test_a_release_whose_cpu_platform_requires_triton_runs_with_no_visible_gpu(version, env):
    # 0.34.0's platforms/cpu.py L241-243 refuses x86 without Triton; vLLM keeps its Triton with no active
    # driver only when CUDA_VISIBLE_DEVICES is set and empty (target.TRITON_REQUIRED_FROM)
    assert vllm_target.triton_env(version) == env

