"""The vLLM shadow target's command: the real `vllm serve` of an engine environment, with kvprobe's
model-less worker (`--worker-cls`), the model folder and the expectation's flags.

Everything a CUDA GPU would decide differently from vLLM's CPU platform is made explicit here, so
that the real scheduler runs with the limits a GPU deployment would have
(what vLLM's CPU platform changes, platforms/cpu.py `check_and_update_config`):

* `--max-num-seqs` / `--max-num-batched-tokens`: the CPU platform defaults to 128 / 2048
  (engine/arg_utils.py `get_batch_defaults`); when the flags leave them out, the GPU's defaults
  for the declared memory are passed, the same numbers kvprobe's ledger uses;
* async scheduling, and the block size of an MLA model: the CPU platform overwrites them before
  the worker runs, so the worker is told what was asked (`kvprobe.targets.shadow.settings.WorkerSettings`);
* the KV pool: a GPU profiles it; the worker is told the declared GPU memory and the ledger's
  estimates, or vLLM's own pool flags decide (`--kv-cache-memory-bytes`,
  `--num-gpu-blocks-override`).
"""

from __future__ import annotations

import os

from kvprobe.engines import vllm as dialect
from kvprobe.errors import ConfigError
from kvprobe.releases import version_tuple
from kvprobe.targets.shadow import modeldir
from kvprobe.targets.shadow.envs import EngineEnv
from kvprobe.targets.shadow.pythonpath import kvprobe_pythonpath
from kvprobe.targets.shadow.settings import ENV_SETTINGS, WORKER_CLS, WorkerSettings, parse_worker_lines
from kvprobe.theory.model.geometry import geometry_from_config
from kvprobe.theory.vllm import batch
from kvprobe.theory.vllm.releases import default_block_size

POOL_FLAGS = ("num-gpu-blocks-override", "kv-cache-memory-bytes")
PARALLEL_FLAGS = ("tensor-parallel-size", "pipeline-parallel-size", "data-parallel-size")
# The releases whose CPU platform turns the `uni` executor into `mp` whatever VLLM_ENABLE_V1_MULTIPROCESSING says
# (platforms/cpu.py L155-156 in 0.20.2, L140-141 in 0.21.0 and 0.22.1; 0.23.0 asks that variable first, L144-151;
# 0.18.1 and 0.19.1 rewrite only for world_size > 1, L202-214). Under `mp` the worker runs in a process of its
# own and what it puts back (async scheduling; MLA's chunked prefill, prefix caching and step budget) never
# reaches EngineCore's scheduler. The uni executor named by its class, which the rewrite's `== "uni"` does not
# match and Executor.get_class resolves (v1/executor/abstract.py L81-82, 0.20.2), keeps the worker in EngineCore.
UNI_REWRITTEN = ((0, 20), (0, 23))  # from, before
UNI_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"
# The first release whose API server takes EngineCore's block size after the KV planner (v1/engine/core_client.py
# L730 in 0.23.0: `cache_config.block_size = response.block_size`). Through 0.22.1 the handshake carries
# num_gpu_blocks alone (v1/engine/core.py L969-980 in 0.18.1), so the API server publishes (/metrics
# cache_config_info) the CPU platform's block size, 128 (platforms/cpu.py L165-166 in 0.18.1), where a GPU
# publishes MLA's 64: an MLA model gets the GPU's block size as a flag there, which the CPU platform keeps
# when the user gave it (the same lines).
BLOCK_SIZE_SYNC_FROM = (0, 23)
# The first release whose CPU platform refuses an x86 machine without Triton (platforms/cpu.py L241-243 in 0.34.0,
# `check_and_update_config`, in every process that builds a VllmConfig; 0.33.0 L241-244 only warned). Its pins
# install Triton (pins/vllm-0.34.0.txt), and vllm/triton_utils/importing.py keeps HAS_TRITON only with exactly
# one active Triton driver (L30-34, L71-78: the CPU backend is never counted) or, with no driver, when
# CUDA_VISIBLE_DEVICES is set and empty (L53-70, the branch for Ray's workers): a CPU has no driver, so the
# server runs with it empty. Nothing else on the CPU platform reads it, and no Triton kernel runs.
TRITON_REQUIRED_FROM = (0, 34)
NO_DEVICES_ENV = {"CUDA_VISIBLE_DEVICES": ""}


def check_request(flags: dict, gpu_memory_bytes: int | None, environ: dict) -> None:
    """The refusals that need no engine: one line each, before anything starts."""
    if dialect.CPU_POOL_ENV in environ:
        raise ConfigError(f"unset {dialect.CPU_POOL_ENV}: vLLM's CPU platform would size the shadow pool from it "
                          "instead of the flags and the declared GPU", key=dialect.CPU_POOL_ENV)
    for name in PARALLEL_FLAGS:
        value = flags.get(name)
        if value not in (None, 1, "1"):
            raise ConfigError(f"the vLLM shadow target runs one model-less worker; {name} must be 1, got {value}",
                              key=f"flags.{name}")
    if gpu_memory_bytes is None and not any(flags.get(f) is not None for f in POOL_FLAGS):
        raise ConfigError("the vLLM shadow target has no GPU to profile: declare hardware.gpu_memory "
                          "(console: --gpu-memory), or give flags.kv-cache-memory-bytes or "
                          "flags.num-gpu-blocks-override", key="hardware.gpu_memory")


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def gpu_batch_flags(config: dict, flags: dict, gpu_memory_bytes: int | None,
                    version: str = dialect.DEFAULT_VERSION) -> dict[str, int]:
    """max-num-seqs / max-num-batched-tokens as `vllm serve` picks them on the declared GPU, for the
    ones the flags leave out (the ledger's `_build_vllm` does the same)."""
    mml = _int(flags.get("max-model-len"))
    max_len = mml if mml and mml > 0 else geometry_from_config(config).max_position_embeddings
    seqs, tokens = batch.vllm_batch_sizes(gpu_memory_bytes, max_len, max_num_seqs=_int(flags.get("max-num-seqs")),
                                           max_num_batched_tokens=_int(flags.get("max-num-batched-tokens")),
                                           version=version)
    out = {}
    if flags.get("max-num-seqs") is None:
        out["max-num-seqs"] = seqs
    if flags.get("max-num-batched-tokens") is None:
        out["max-num-batched-tokens"] = tokens
    return out


def worker_settings(flags: dict, gpu_memory_bytes: int | None, estimates: dict,
                    version: str = dialect.DEFAULT_VERSION, gpu_capability: str | None = None) -> WorkerSettings:
    """What the worker must put back or size by: from the flags as written (a bare switch is True,
    `--no-x` is False, absent is vLLM's default on a CUDA GPU for this version, as the ledger takes it)."""
    prefix = flags.get("enable-prefix-caching")
    asked = flags.get("async-scheduling")
    return WorkerSettings(async_scheduling=dialect.async_scheduling_default(version) if asked is None else bool(asked),
                          block_size=_int(flags.get("block-size")),
                          chunked_prefill=flags.get("enable-chunked-prefill") is not False,
                          prefix_caching=None if prefix is None else bool(prefix),
                          max_num_batched_tokens=_int(flags.get("max-num-batched-tokens")),
                          mamba_ssm_cache_dtype=str(flags.get("mamba-ssm-cache-dtype") or "auto"),
                          gpu_memory_bytes=gpu_memory_bytes, gpu_capability=gpu_capability,
                          estimates={k: int(v) for k, v in (estimates or {}).items()})


def published_block_flags(config: dict, flags: dict, version: str) -> dict[str, int]:
    """`block-size` for an MLA model on a release whose API server would publish the CPU platform's block
    size (`BLOCK_SIZE_SYNC_FROM`) when the flags leave it out, else nothing."""
    if flags.get("block-size") is not None or version_tuple(version)[:2] >= BLOCK_SIZE_SYNC_FROM:
        return {}
    geom = geometry_from_config(config)
    return {"block-size": default_block_size(version, mla=True)} if geom.attention == "mla" else {}


def triton_env(version: str) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES="" for a release whose CPU platform requires Triton (`TRITON_REQUIRED_FROM`), else
    nothing."""
    return dict(NO_DEVICES_ENV) if version_tuple(version)[:2] >= TRITON_REQUIRED_FROM else {}


def executor_flags(version: str) -> list[str]:
    """`--distributed-executor-backend` for a release whose CPU platform would move the worker out of
    EngineCore (`UNI_REWRITTEN`), else nothing."""
    first, before = UNI_REWRITTEN
    if first <= version_tuple(version)[:2] < before:
        return ["--distributed-executor-backend", UNI_EXECUTOR]
    return []


def command(req, env: EngineEnv) -> tuple[list[str], dict[str, str]]:
    """`vllm serve FOLDER --worker-cls ... --served-model-name NAME [flags]` and its environment
    (kvprobe.targets.shadow.launch adds settings.ACTIVE_ENV, the time model and the dialect's SHADOW_ENV)."""
    flags = dict(req.flags)
    check_request(flags, req.gpu_memory_bytes, {**os.environ, **req.extra_env})
    folder = modeldir.model_folder(req.model, req.config, env)
    flags.update(gpu_batch_flags(req.config, flags, req.gpu_memory_bytes, req.version))
    flags.update(published_block_flags(req.config, flags, req.version))
    argv = dialect.launch_command(str(folder), flags, host=req.host, port=req.port,
                                  binary=[str(env.bin("vllm")), "serve"])
    argv += ["--served-model-name", req.served_model_name, "--worker-cls", WORKER_CLS, *executor_flags(req.version)]
    settings = worker_settings(flags, req.gpu_memory_bytes, req.estimates, req.version, req.gpu_capability)
    environ = {"PYTHONPATH": str(kvprobe_pythonpath()), ENV_SETTINGS: settings.encode(), **triton_env(req.version)}
    return argv, environ


def parse_worker_log(text: str) -> dict:
    """What the worker said at start-up: the scheduler it ran, async scheduling, how the pool was sized."""
    return parse_worker_lines(text)
