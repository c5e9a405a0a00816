"""vLLM's command line (engine/arg_utils.py, 0.33.0): the flags kvprobe models, the ones it passes
through, the environment of a CPU shadow, and the commands that start a server or the emulator."""

from __future__ import annotations

import sys

from kvprobe.engines.base import Flag, render_flags
from kvprobe.engines.vllm.versions import NAME
from kvprobe.errors import ConfigError
from kvprobe.theory.vllm.releases import (
    ACTIVE_SEQS_FROM,
    EXTENSIBLE_KV_CACHE_FROM,
    KV_CACHE_MEMORY_BYTES_FROM,
    WATERMARK_FROM,
)

# --- flags (engine/arg_utils.py::add_cli_args, 0.33.0). Defaults are the emulator's where the real one
# depends on the GPU (max-num-seqs / max-num-batched-tokens: the <70 GiB tier, 256 / 2048).
FLAGS: dict[str, Flag] = {f.name: f for f in (
    Flag("served-model-name", str, None, "the model name clients send: /v1/models and the model_name metric label"),
    Flag("num-gpu-blocks-override", int, None, "the KV pool in blocks (the null block included), instead of profiling "
         "memory", lo=1,
         ledger="num_gpu_blocks_override"),
    Flag("block-size", int, 16, "tokens per KV cache block", lo=1, ledger="block_size"),
    Flag("max-model-len", int, 8192, "the longest sequence, prompt + output tokens (-1 or auto: the longest that "
         "fits the pool)", kind="len", lo=1,
         ledger="max_model_len"),
    Flag("max-num-seqs", int, 256, "the most requests running at once", lo=1, ledger="max_num_seqs"),
    # 0.31.0 on (kvprobe/theory/vllm/releases.py ACTIVE_SEQS_FROM): the ledger refuses it for an older release
    Flag("max-num-active-seqs", int, None, "the most requests RUNNING at once, below max-num-seqs (vLLM 0.31.0 on)",
         lo=1, ledger="max_num_active_seqs", since=ACTIVE_SEQS_FROM),
    Flag("max-num-batched-tokens", int, 2048, "tokens scheduled per step (8k = 8000, 8K = 8192)", kind="count", lo=1,
         ledger="max_num_batched_tokens"),
    Flag("enable-prefix-caching", None, True, "reuse the cached blocks of a shared prompt prefix", negatable=True,
         ledger="enable_prefix_caching"),
    Flag("enable-chunked-prefill", None, True, "split long prompts over steps", negatable=True),
    Flag("scheduler-reserve-full-isl", None, True, "admit only if the whole prompt fits (new after 0.11.0)",
         negatable=True, ledger="reserve_full_isl"),
    Flag("watermark", float, 0.0, "fraction of blocks kept free when admitting (vLLM 0.24.0 on)", lo=0,
         ledger="watermark", since=WATERMARK_FROM),
    # None = the engine's default for the version and platform: async_scheduling_default() below.
    Flag("async-scheduling", None, None, "schedule the next step while one runs: blocks are taken one step earlier and "
         "freed one step later (default: on where the engine supports it)", negatable=True,
         ledger="async_scheduling"),
    # entrypoints/common/cli_args.py L335 (list[str], nargs "+"; the emulator takes one key per flag).
    # Secret: never printed by the emulator; prefer the VLLM_API_KEY environment variable, which keeps
    # the key out of the process list.
    Flag("api-key", str, None, "require `Authorization: Bearer KEY` on /v1/* (or env VLLM_API_KEY)"),
    # engine/arg_utils.py L630/L1920: no stat loggers -> no vllm:* families on /metrics (see below)
    Flag("disable-log-stats", None, False, "disable engine statistics (the vllm:* metric families)"),
    Flag("gpu-memory-utilization", float, 0.92, "the fraction of GPU memory vLLM may use (weights, activations, KV)",
         emulated=False,
         kind="frac", ledger="gpu_memory_utilization"),
    Flag("kv-cache-memory-bytes", str, None, "the KV pool in bytes (10G = 10 GiB, 10g = 10^10), instead of profiling "
         "memory", emulated=False,
         kind="bytes", lo=1, ledger="kv_cache_memory_bytes", since=KV_CACHE_MEMORY_BYTES_FROM),
    # 0.34.0 on (kvprobe/theory/vllm/releases.py EXTENSIBLE_KV_CACHE_FROM): the pool sized after warm-up
    Flag("enable-extensible-kv-cache", None, None, "size the KV pool after warm-up and CUDA-graph capture (vLLM "
         "0.34.0 on; default: on a CUDA GPU unless the pool is given)", negatable=True, emulated=False,
         ledger="enable_extensible_kv_cache", since=EXTENSIBLE_KV_CACHE_FROM),
    Flag("kv-cache-dtype", str, "auto", "the KV cache dtype (auto: the model's)", emulated=False,
         ledger="kv_cache_dtype"),
    Flag("quantization", str, None, "the weights' quantisation method (fp8: online FP8 of a 16-bit checkpoint)",
         emulated=False, ledger="quantization"),
    Flag("dtype", str, "auto", "model dtype", emulated=False, ledger="dtype"),
    Flag("tensor-parallel-size", int, 1, "tensor parallel GPUs", emulated=False, lo=1, ledger="tp"),
    Flag("pipeline-parallel-size", int, 1, "PP degree", emulated=False, lo=1, ledger="pp"),
    Flag("data-parallel-size", int, 1, "DP degree", emulated=False, lo=1, ledger="dp"),
    # 0.29.0 engine/arg_utils.py L1199-1203; fused_moe/config.py L1212-1256: the experts whole over TP x DP ranks
    Flag("enable-expert-parallel", None, False, "place the MoE experts whole over the TP x DP ranks (expert "
         "parallelism) instead of splitting each by TP", negatable=True, emulated=False,
         ledger="enable_expert_parallel"),
    # engine/arg_utils.py L1947-1953 (0.33.0; in every release read from 0.18.1, whose L1326-1332 takes flashinfer or
    # triton only): the kernel of a Gated DeltaNet layer's prefill, of which only FlashInfer's takes a checkpoint
    # block (theory/vllm/hybrid/kv_cache_spec.py; the ledger reads it from 0.33.0, the first release with one)
    Flag("gdn-prefill-backend", str, None, "a Gated DeltaNet layer's prefill kernel: flashinfer, triton, cutedsl "
         "(default: FlashInfer's where the GPU runs it, Triton/FLA elsewhere)", ledger="gdn_prefill_backend"),
    # gpu_worker.py (0.18.1 L397-399, 0.33.0 the same): no graph profiled in the memory window, none captured
    Flag("enforce-eager", None, False, "no CUDA graphs: none profiled or captured, no graph memory "
         "(and less non-torch memory) before the KV pool", emulated=False, ledger="enforce_eager"),
)}
# 0.33.0 arg_utils.py L1814: the API server streams every N tokens (the first at once)
STREAM_INTERVAL_FLAG = "stream-interval"
# Real vLLM flags kvprobe does not model: passed through to `vllm serve` as written, and listed so
# that an expectation's near-miss typo check does not refuse them.
OTHER_FLAGS = (
    "max-num-scheduled-tokens", "long-prefill-token-threshold",
    "scheduling-policy", "prefill-schedule-interval", "max-num-queued-reqs",
    "max-num-queued-tokens", "disable-hybrid-kv-cache-manager",
    "performance-mode", "trust-remote-code", "seed", "swap-space", "cpu-offload-gb",
    "disable-log-requests", "enable-log-requests", "tokenizer", "revision", "load-format",
    STREAM_INTERVAL_FLAG,
)
FLAG_ALIASES = {"device-memory-utilization": "gpu-memory-utilization", "tp": "tensor-parallel-size"}


# --- running the real server on a CPU with a model-less worker (verified with 0.33.0).
# VLLM_TARGET_DEVICE: DeviceConfig cannot infer a device otherwise;
# VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the `uni` executor (platforms/cpu.py rewrites it to `mp`
# and spawns an extra worker process otherwise); the rest keeps the engine off the network.
SHADOW_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# platforms/cpu.py L340-344: a set VLLM_CPU_KVCACHE_SPACE (GiB) replaces kv_cache_memory_bytes, even
# --kv-cache-memory-bytes; envs.py L896-900 refuses an empty value, so it cannot be cleared, only refused.
CPU_POOL_ENV = "VLLM_CPU_KVCACHE_SPACE"


REQUEST_CAP_FLAG = "max-num-seqs"  # engine/arg_utils.py L1754; scheduler.py caps len(running) by it
TOKEN_BUDGET_FLAG = "max-num-batched-tokens"  # engine/arg_utils.py L1740


# --- commands
def launch_command(model: str, flags: dict[str, object], *, host: str, port: int,
                   binary: list[str] | None = None, served_model_name: str | None = None) -> list[str]:
    """`vllm serve MODEL --host H --port P [--served-model-name NAME] ...` (entrypoints/cli/serve.py:
    positional model_tag, the path or hub id loaded). Clients then send NAME (/v1/models `id`);
    without it vLLM serves the model under MODEL itself (config/model.py served_model_name)."""
    flags = dict(flags)
    if served_model_name and served_model_name != model:
        flags["served-model-name"] = served_model_name
    return [*(binary or ["vllm", "serve"]), model, "--host", host, "--port", str(port), *render_flags(flags, FLAGS)]


def emulator_command(model: str, flags: dict[str, object], *, host: str, port: int,
                     extra: list[str] | tuple[str, ...] = (), version: str | None = None) -> list[str]:
    """`python -m kvprobe emulate vllm ...`; flags the emulator does not model are dropped
    (the pool must be given as num-gpu-blocks-override). `version` selects version-keyed behaviour."""
    if flags.get("num-gpu-blocks-override") is None:
        raise ConfigError("the vLLM emulator needs flags.num-gpu-blocks-override (the pool in blocks)",
                          key="flags.num-gpu-blocks-override")
    kept = {k: v for k, v in flags.items() if k in FLAGS and FLAGS[k].emulated}
    return [sys.executable, "-m", "kvprobe", "emulate", NAME, "--model", model, "--host", host,
            "--port", str(port), *render_flags(kept, FLAGS), *(["--engine-version", version] if version else []),
            *extra]
