"""SGLang's command line (server_args.py / arg_groups/fields/*.py, 0.5.23): the flags kvprobe
models, the ones it passes through, the shadow's environment and flags, and the commands that start
a server or the emulator."""

from __future__ import annotations

import sys

from kvprobe.engines.base import Flag, render_flags
from kvprobe.engines.sglang.metrics import DECODE_LOG_INTERVAL
from kvprobe.engines.sglang.versions import NAME
from kvprobe.errors import ConfigError

# --- running the real server on a CPU with kvprobe's plugin (verified with 0.5.23): no hub, no telemetry.
# When a member of the group dies (a stop sends SIGTERM to all of them), the tokenizer manager sleeps
# 5 s "to let GPU activity settle" before py-spy and CUDA coredump diagnostics
# (managers/tokenizer_manager.py L3395-3486; environ.py L401-402): there is no GPU and no py-spy here,
# so both are off and a stop takes ~1 s instead of ~7.
SHADOW_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
}
# Flags the shadow always passes: SGLang picks the device from the machine (no CUDA -> CPU); it is
# stated so a log reads the same on every machine. /metrics is what a probe reads. --sleep-on-idle
# (arg_groups/fields/device.py L74; managers/scheduler_components/idle_sleeper.py): a fully idle
# scheduler waits on its zmq sockets (waking at once for a request) instead of spinning — measured
# here, an idle shadow scheduler otherwise takes 70% of a core from the tokenizer, the detokenizer and
# the load generator on a two-core machine. Only the fully idle loop changes; admission does not.
SHADOW_FLAGS = {"device": "cpu", "enable-metrics": True, "sleep-on-idle": True}

# --- flags (server_args.py / arg_groups/fields/*.py, 0.5.23). GPU-tier defaults are the emulator's.
FLAGS: dict[str, Flag] = {f.name: f for f in (
    Flag("served-model-name", str, None, "model_name label / /v1/models id"),
    Flag("max-total-tokens", int, None, "the KV pool in tokens, instead of sizing it from GPU memory", lo=1,
         ledger="max_total_tokens"),
    Flag("context-length", int, 8192, "the longest sequence, prompt + output tokens", lo=1, ledger="context_length"),
    Flag("max-running-requests", int, None, "the most requests running at once (default: from the pool size)", lo=1,
         ledger="max_running_requests"),
    Flag("chunked-prefill-size", int, 8192, "prompt tokens prefilled per step (-1: no chunking)",
         ledger="chunked_prefill_size"),
    Flag("max-prefill-tokens", int, 16384, "prompt tokens admitted per prefill step", lo=1),
    Flag("page-size", int, 1, "tokens per KV cache page", lo=1, ledger="page_size"),
    Flag("schedule-conservativeness", float, 1.0, "how much room admission keeps for output to come (a multiplier)",
         lo=0),
    Flag("disable-radix-cache", None, False, "do not reuse cached prompt prefixes", ledger="disable_radix_cache"),
    Flag("disable-overlap-schedule", None, False, "schedule the next step only after one ends",
         ledger="disable_overlap_schedule"),
    Flag("enable-metrics", None, False, "serve Prometheus metrics on /metrics"),
    Flag("decode-log-interval", int, DECODE_LOG_INTERVAL, "decode batches between metric reports", lo=1),
    # arg_groups/fields/serving.py L160-163 (Optional[str]); no environment variable. Secret: never printed.
    Flag("api-key", str, None, "require `Authorization: Bearer KEY` on every path but /health*, /ready*, /metrics*"),
    Flag("mem-fraction-static", float, None, "fraction of GPU memory for weights + KV", emulated=False,
         kind="frac", ledger="mem_fraction_static"),
    Flag("kv-cache-dtype", str, "auto", "KV cache dtype", emulated=False, ledger="kv_cache_dtype"),
    Flag("quantization", str, None, "weight quantisation; the ledger counts fp8 (online FP8 of a 16-bit "
         "checkpoint) and the checkpoint's own", emulated=False, ledger="quantization"),
    Flag("dtype", str, "auto", "model dtype", emulated=False, ledger="dtype"),
    Flag("tp-size", int, 1, "tensor parallel GPUs", emulated=False, lo=1, ledger="tp"),
    Flag("pp-size", int, 1, "pipeline parallel size", emulated=False, lo=1, ledger="pp"),
    Flag("dp-size", int, 1, "data parallel size", emulated=False, lo=1, ledger="dp"),
    Flag("cuda-graph-max-bs", int, None, "decode cuda-graph max batch size (older name)", emulated=False, lo=1),
    # The graph reserves each drops from the default mem_fraction_static, by release: --disable-cuda-graph
    # theory/sglang/memory_profile.py cuda_graph_reserves_dropped; --disable-piecewise-cuda-graph (0.5.10-0.5.19
    # only, not in 0.5.23: the ledger refuses it for other releases) _PIECEWISE_FLAG there.
    Flag("disable-cuda-graph", None, False, "no cuda graphs (from 0.5.14 no memory reserved for them either)",
         emulated=False, ledger="disable_cuda_graph"),
    Flag("disable-piecewise-cuda-graph", None, False, "0.5.10-0.5.19: no prefill (piecewise) cuda graphs, and no "
         "memory reserved for them", emulated=False, ledger="disable_piecewise_cuda_graph"),
    # window pool tokens / full pool tokens of a hybrid sliding-window model (schedule.py L150-162;
    # unset resolves to 0.8; pool_configurator.py L880-891)
    Flag("swa-full-tokens-ratio", float, None, "sliding-window models: window pool / full pool tokens (default 0.8)",
         kind="frac", ledger="swa_full_tokens_ratio"),
    # The other hybrid-pool flags (arg_groups/fields/schedule.py L182-186, L211-227; exec_.py
    # L490-530): hybrid SWA memory off, the recurrent-state slots and their share of the budget, how
    # the radix cache keeps Mamba states, the state dtype. theory/sglang/pools.py models their effect.
    Flag("disable-hybrid-swa-memory", None, False, "hybrid SWA models: one full pool over every layer",
         ledger="disable_hybrid_swa_memory"),
    Flag("max-mamba-cache-size", int, None, "recurrent-state slots (default: from the memory budget)", lo=1,
         ledger="max_mamba_cache_size"),
    Flag("mamba-full-memory-ratio", float, None, "recurrent-state bytes : full pool bytes (default 0.9)", kind="frac",
         ledger="mamba_full_memory_ratio"),
    Flag("mamba-radix-cache-strategy", str, None, "how the radix cache keeps Mamba states (default extra_buffer)",
         ledger="mamba_radix_cache_strategy"),
    Flag("mamba-ssm-dtype", str, None, "recurrent state dtype (default: the config's, else float32)",
         ledger="mamba_ssm_dtype"),
)}
# Quantization methods SGLang 0.5.23 registers only on CUDA/HIP/XPU, or on a CPU with
# SGLANG_USE_CPU_ENGINE=1 (`is_cpu()`, which then needs sgl_kernel) (layers/quantization/__init__.py
# L96-104): otherwise a config naming one fails with "Unknown quantization method: mxfp4". The weights'
# format does not touch the KV pools, so the shadow's model folder leaves the config's
# quantization_config out for these.
CPU_UNREGISTERED_QUANTIZATION = ("mxfp4",)
# 0.5.23 managers/scheduler_components/output_streamer.py L455-469: a stream gets its first token at once,
# then whenever `--stream-interval` tokens are unsent (the default 1: every step)
STREAM_INTERVAL_FLAG = "stream-interval"
# Real SGLang flags kvprobe does not model: passed through as written; listed for the typo check.
OTHER_FLAGS = (
    "max-queued-requests", "schedule-policy", "retraction-policy", "enable-mixed-chunk",
    "allow-auto-truncate", "enable-priority-scheduling", "radix-eviction-policy",
    "extra-metric-labels", "trust-remote-code", "random-seed",
    "attention-backend", "tokenizer-path", "revision", "load-format", "cuda-graph-max-bs-decode",
    STREAM_INTERVAL_FLAG, "sleep-on-idle", "device", "sampling-backend",
)
FLAG_ALIASES = {"tensor-parallel-size": "tp-size", "pipeline-parallel-size": "pp-size",
                "data-parallel-size": "dp-size"}

REQUEST_CAP_FLAG = "max-running-requests"  # reported as effective_max_running_requests_per_dp (/server_info)
TOKEN_BUDGET_FLAG = "chunked-prefill-size"


# --- commands
LAUNCH_MODULE = "sglang.launch_server"  # launch_server.py (0.5.23; warns that `sglang serve` is preferred)


def launch_command(model: str, flags: dict[str, object], *, host: str, port: int,
                   binary: list[str] | None = None, served_model_name: str | None = None) -> list[str]:
    """`python -m sglang.launch_server --model-path MODEL --host H --port P [--served-model-name NAME] ...`
    (launch_server.py). MODEL is loaded; clients send NAME, which defaults to MODEL
    (arg_groups/fields/serving.py served_model_name)."""
    flags = dict(flags)
    if served_model_name and served_model_name != model:
        flags["served-model-name"] = served_model_name
    return [*(binary or ["python", "-m", LAUNCH_MODULE]), "--model-path", model, "--host", host,
            "--port", str(port), *render_flags(flags, FLAGS)]


def emulator_command(model: str, flags: dict[str, object], *, host: str, port: int,
                     extra: list[str] | tuple[str, ...] = (), version: str | None = None) -> list[str]:
    """`python -m kvprobe emulate sglang ...`; flags the emulator does not model are dropped (the pool
    must be given as max-total-tokens). --enable-metrics is added: a probe needs /metrics."""
    if flags.get("max-total-tokens") is None:
        raise ConfigError("the SGLang emulator needs flags.max-total-tokens (the pool in tokens)",
                          key="flags.max-total-tokens")
    kept = {k: v for k, v in flags.items() if k in FLAGS and FLAGS[k].emulated}
    kept.setdefault("enable-metrics", True)
    return [sys.executable, "-m", "kvprobe", "emulate", NAME, "--model-path", model, "--host", host,
            "--port", str(port), *render_flags(kept, FLAGS), *(["--engine-version", version] if version else []),
            *extra]
