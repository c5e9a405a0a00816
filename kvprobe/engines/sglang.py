"""SGLang's wire facts: flags, startup lines, metric names, error bodies, endpoint shapes.

Source: SGLang 0.5.23 (PyPI wheel, no git commit recorded), file:line from shared/reference/sglang.md
and shared/fixtures/ (errors.md, sglang-*.md). Older-version differences are noted where they matter.
"""

from __future__ import annotations

import re
import sys
import time

from kvprobe.engines.base import Flag, MetricMap, ReportedCapacity, render_flags
from kvprobe.errors import ConfigError
from kvprobe.theory.sglang.releases import policy as release_policy

NAME = "sglang"
DEFAULT_VERSION = "0.5.23"
DEFAULT_PORT = 30000  # arg_groups/fields/serving.py L65-66
# /health submits a 1-token generate and answers 200 once the scheduler replies (http_server.py L721-799);
# 503 while starting or shutting down.
HEALTH_PATH = "/health"
# /health is a generation: it sleeps 1 s before it looks for any scheduler output, and under load it
# waits for the running batch's next output (http_server.py L723-800; a busy scheduler skips the
# request itself, scheduler.py L2240-2247) — too slow to poll. /ready answers from the tokenizer
# manager's state at once (http_server.py L714-718).
ALIVE_PATH = "/ready"
INFO_PATHS = ("/server_info", "/v1/models")
# Versions whose facts this module holds: 0.5.23 throughout; 0.5.22 and 0.5.21 where the admission
# reservation of ignore_eos requests differs (policy() below).
KNOWN_VERSIONS = ("0.5.21", "0.5.22", "0.5.23")
COMPLETIONS_PATH = "/v1/completions"  # entrypoints/http_server.py L1860-1867

# --- running the real server on a CPU with kvprobe's plugin (shared/reference/shadow-engines.md,
# verified with 0.5.23): no hub, no telemetry. When a member of the group dies (a stop sends SIGTERM
# to all of them), the tokenizer manager sleeps 5 s "to let GPU activity settle" before py-spy and
# CUDA coredump diagnostics (managers/tokenizer_manager.py L3395-3486; environ.py L401-402): there is
# no GPU and no py-spy here, so both are off and a stop takes ~1 s instead of ~7.
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

# --- metrics (observability/metrics_collector.py, 0.5.23; checked against fixtures/sglang-0.5.23-metrics.txt)
LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")  # L1382-1394
TOKENIZER_LABELS = ("model_name", "engine_type")  # L1804-1819 (+ is_streaming on request histograms)
METRICS = MetricMap(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    usage="sglang:token_usage",
    preemptions="sglang:num_retracted_requests",  # counter, exposed as ..._total
    used_tokens="sglang:num_used_tokens",
    pool_tokens="sglang:max_total_num_tokens",
    ttft="sglang:time_to_first_token_seconds",
    success="sglang:num_requests",
    extra={
        "new_token_ratio": "sglang:new_token_ratio",
        "retracted_gauge": "sglang:num_retracted_reqs",
        "context_len": "sglang:context_len",
        "page_size": "sglang:page_size",
        "kv_used_tokens": "sglang:kv_used_tokens",
        "kv_available_tokens": "sglang:kv_available_tokens",
        "kv_evictable_tokens": "sglang:kv_evictable_tokens",
        "num_pages": "sglang:num_pages",
        "prompt_tokens": "sglang:prompt_tokens",
        "generation_tokens": "sglang:generation_tokens",
        "e2e": "sglang:e2e_request_latency_seconds",
        # tokens/s over the last decode-log window (every decode_log_interval steps); the token
        # counters above move only when a request finishes
        "gen_throughput": "sglang:gen_throughput",
    },
)
# Retraction (check_decode_mem fails -> retract_decode): a WARNING line per retraction, and the labelled
# counter sglang:num_retracted_requests_total, which does not exist before the first retraction —
# absent is neither an error nor a zero (scheduler.py L4520-4530; shadow-engines.md "Metrics to know").
RETRACT_LOG = "KV cache pool is full. Retract requests."
# SGLang's own pool check whenever the scheduler is idle (scheduler.py on_idle L5281-5307,
# invariant_checker.py L452-459 `_report_leak`): strict by default (environ.py L502
# SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE), so a leaked token raises in the scheduler and the server
# dies; not strict, it logs this.
LEAK_LOG = "memory leak detected!"

# Scheduler gauges are written at prefill batches, every decode_log_interval decode batches and on idle
# (metrics_reporter.py L719-1140, L1476-1520).
DECODE_LOG_INTERVAL = 40
IDLE_REPORT_SECONDS = 30.0
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
                400.0)  # L1965-1985
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
               400.0, 600.0, 1200.0, 1800.0, 2400.0)
HELP = {
    "sglang:num_running_reqs": "The number of running requests.",
    "sglang:num_queue_reqs": "The number of requests in the waiting queue.",
    "sglang:token_usage": "The token usage.",
    "sglang:num_used_tokens": "The number of used tokens.",
    "sglang:kv_used_tokens": "Number of actively used token slots in the KV cache pool.",
    "sglang:kv_available_tokens": "Number of free token slots in the KV cache pool.",
    "sglang:kv_evictable_tokens": "Number of evictable (radix-cached) token slots in the KV cache pool.",
    "sglang:max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
    "sglang:page_size": "KV cache page size in tokens.",
    "sglang:num_pages": "Number of KV cache pages.",
    "sglang:context_len": "Maximum context length.",
    "sglang:new_token_ratio": "The new token ratio.",
    "sglang:num_retracted_reqs": "The number of retracted requests.",
    "sglang:num_retracted_requests": "Total number of retracted requests.",
    "sglang:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "sglang:e2e_request_latency_seconds": "Histogram of End-to-end request latency in seconds",
    "sglang:prompt_tokens": "Number of prefill tokens processed.",
    "sglang:generation_tokens": "Number of generation tokens processed.",
    "sglang:num_requests": "Number of requests processed.",
}

# --- flags (server_args.py / arg_groups/fields/*.py, 0.5.23). GPU-tier defaults are the emulator's.
FLAGS: dict[str, Flag] = {f.name: f for f in (
    Flag("served-model-name", str, None, "model_name label / /v1/models id"),
    Flag("max-total-tokens", int, None, "KV pool size in tokens (schedule.py L39-51)", lo=1, ledger="max_total_tokens"),
    Flag("context-length", int, 8192, "context_len (model.py L110-116)", lo=1, ledger="context_length"),
    Flag("max-running-requests", int, None, "running cap; None -> resolve_max_num_reqs", lo=1,
         ledger="max_running_requests"),
    Flag("chunked-prefill-size", int, 8192, "per-pass prefill chunk; -1 disables (L52-55)", ledger="chunked_prefill_size"),
    Flag("max-prefill-tokens", int, 16384, "per-pass prefill token budget (L71-81)", lo=1),
    Flag("page-size", int, 1, "tokens per page (L143-145)", lo=1, ledger="page_size"),
    Flag("schedule-conservativeness", float, 1.0, "scales new_token_ratio (L139-142)", lo=0),
    Flag("disable-radix-cache", None, False, "no prefix cache (memory.py L64-70)", ledger="disable_radix_cache"),
    Flag("disable-overlap-schedule", None, False, "no overlap scheduler (schedule.py L193-199)",
         ledger="disable_overlap_schedule"),
    Flag("enable-metrics", None, False, "serve /metrics (observability.py L70)"),
    Flag("decode-log-interval", int, DECODE_LOG_INTERVAL, "decode batches between metric reports", lo=1),
    # arg_groups/fields/serving.py L160-163 (Optional[str]); no environment variable. Secret: never printed.
    Flag("api-key", str, None, "require `Authorization: Bearer KEY` on every path but /health*, /ready*, /metrics*"),
    Flag("mem-fraction-static", float, None, "fraction of GPU memory for weights + KV", emulated=False,
         kind="frac", ledger="mem_fraction_static"),
    Flag("kv-cache-dtype", str, "auto", "KV cache dtype", emulated=False, ledger="kv_cache_dtype"),
    Flag("dtype", str, "auto", "model dtype", emulated=False, ledger="dtype"),
    Flag("tp-size", int, 1, "tensor parallel size (parallel.py L45-51)", emulated=False, lo=1, ledger="tp"),
    Flag("pp-size", int, 1, "pipeline parallel size", emulated=False, lo=1, ledger="pp"),
    Flag("dp-size", int, 1, "data parallel size", emulated=False, lo=1, ledger="dp"),
    Flag("cuda-graph-max-bs", int, None, "decode cuda-graph max batch size (older name)", emulated=False, lo=1),
    # window pool tokens / full pool tokens of a hybrid sliding-window model (schedule.py L150-162;
    # unset resolves to 0.8; pool_configurator.py L880-891)
    Flag("swa-full-tokens-ratio", float, None, "hybrid SWA: window pool / full pool tokens (None -> 0.8)",
         kind="frac", ledger="swa_full_tokens_ratio"),
    # The other hybrid-pool flags (arg_groups/fields/schedule.py L182-186, L211-227; exec_.py
    # L490-530): hybrid SWA memory off, the recurrent-state slots and their share of the budget, how
    # the radix cache keeps Mamba states, the state dtype. theory/sglang_pools.py models their effect.
    Flag("disable-hybrid-swa-memory", None, False, "hybrid SWA models: one full pool over every layer",
         ledger="disable_hybrid_swa_memory"),
    Flag("max-mamba-cache-size", int, None, "recurrent-state slots (None -> from the budget)", lo=1,
         ledger="max_mamba_cache_size"),
    Flag("mamba-full-memory-ratio", float, None, "state slots : full pool bytes (None -> 0.9)", kind="frac",
         ledger="mamba_full_memory_ratio"),
    Flag("mamba-radix-cache-strategy", str, None, "how the radix cache keeps Mamba states (None -> extra_buffer)",
         ledger="mamba_radix_cache_strategy"),
    Flag("mamba-ssm-dtype", str, None, "recurrent state dtype (None -> the config's, else float32)",
         ledger="mamba_ssm_dtype"),
)}
# Quantization methods SGLang 0.5.23 registers only on CUDA/HIP/XPU, or on a CPU with
# SGLANG_USE_CPU_ENGINE=1 (`is_cpu()`, which then needs sgl_kernel) (layers/quantization/__init__.py
# L96-104): otherwise a config naming one fails with "Unknown quantization method: mxfp4". The weights'
# format does not touch the KV pools, so the shadow's model folder leaves the config's
# quantization_config out for these.
CPU_UNREGISTERED_QUANTIZATION = ("mxfp4",)
# Real SGLang flags kvprobe does not model: passed through as written; listed for the typo check.
OTHER_FLAGS = (
    "max-queued-requests", "schedule-policy", "retraction-policy", "enable-mixed-chunk",
    "allow-auto-truncate", "enable-priority-scheduling", "radix-eviction-policy",
    "extra-metric-labels", "trust-remote-code", "quantization", "random-seed", "disable-cuda-graph",
    "attention-backend", "tokenizer-path", "revision", "load-format", "cuda-graph-max-bs-decode",
    "stream-interval", "sleep-on-idle", "device",
)
FLAG_ALIASES = {"tensor-parallel-size": "tp-size", "pipeline-parallel-size": "pp-size",
                "data-parallel-size": "dp-size"}


# --- API key (utils/auth.py add_api_key_middleware + decide_request_auth, 0.5.23): with --api-key every
# NORMAL endpoint (/generate, /v1/*, /server_info, /model_info, ...) needs `Authorization: Bearer KEY`;
# OPTIONS and paths starting with these prefixes are always allowed (k8s probes, Prometheus scraping).
API_KEY_ENV = None  # SGLang reads the key from --api-key only
AUTH_EXEMPT_PREFIXES = ("/health", "/ready", "/metrics")
UNAUTHORIZED_STATUS = 401
UNAUTHORIZED_BODY = {"error": "Unauthorized"}  # ORJSONResponse, auth.py L193-202


def auth_required(method: str, path: str) -> bool:
    return method != "OPTIONS" and not path.startswith(AUTH_EXEMPT_PREFIXES)


def bearer_token(authorization: str | None) -> str | None:
    """auth.py `_check_bearer_token`: `split(" ", 1)`, exactly two parts, scheme case-insensitive."""
    if not authorization:
        return None
    parts = authorization.split(" ", 1)
    return parts[1] if len(parts) == 2 and parts[0].lower() == "bearer" else None


def _vt(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def policy(version: str) -> str:
    """0.5.22 reserves ignore_eos requests at ratio 1.0; 0.5.21 and older scale by new_token_ratio
    (the theory's release rule, theory/sglang/releases.py)."""
    return release_policy(version)


def max_req_input_len(context_len: int, max_total_num_tokens: int) -> int:
    """managers/tp_worker.py L568-572: min(context_len - 1, M - 1) - 5 (theory owns it)."""
    from kvprobe.theory.sglang.budget import sglang_max_req_input_len

    return sglang_max_req_input_len(context_len, max_total_num_tokens)


def resolve_max_running_requests(max_total_num_tokens: int, context_len: int, user_value: int | None) -> int:
    """resolve_max_num_reqs (kv_cache_configurator.py, reference §1.4); theory owns it."""
    from kvprobe.theory.sglang.budget import sglang_default_max_running_requests

    return sglang_default_max_running_requests(max_total_num_tokens, context_len, user_value)


# --- startup lines: `[%Y-%m-%d %H:%M:%S{prefix}] message` (utils/common.py configure_logger L2618-2638);
# the ` TPn` part appears only with TP > 1.
def log_prefix(t: float | None = None) -> str:
    return "[" + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + "] "


def capacity_line(*, max_total_num_tokens: int, chunked_prefill_size: int, max_prefill_tokens: int,
                  max_running_requests: int, context_len: int, available_gpu_mem: float = 0.0) -> str:
    """managers/scheduler.py L1267-1276 (TP rank 0)."""
    return (log_prefix() + f"max_total_num_tokens={max_total_num_tokens}, chunked_prefill_size={chunked_prefill_size}, "
            f"max_prefill_tokens={max_prefill_tokens}, max_running_requests={max_running_requests}, "
            f"context_len={context_len}, available_gpu_mem={available_gpu_mem:.2f} GB")


def startup_lines(*, max_total_num_tokens: int, chunked_prefill_size: int, max_prefill_tokens: int,
                  max_running_requests: int, context_len: int, bytes_per_token: int = 131072,
                  swa_tokens: int | None = None) -> list[str]:
    """KV line (mem_cache/memory_pool.py L2087-2091, nominal bytes: the emulator has none), the
    context warning of tp_worker.py get_worker_info, then the capacity line. With a window pool
    (`swa_tokens`, hybrid SWA): the configurator's line (pool_configurator.py L888-891) and one KV
    line per pool, labelled "Full" and "SWA" (memory_pool.py L2077-2081; SWAKVPool)."""
    k_gb = max_total_num_tokens * bytes_per_token / 2 / 2**30
    kv = (f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {max_total_num_tokens}, "
          f"K size: {k_gb:.2f} GB, V size: {k_gb:.2f} GB")
    if swa_tokens is None:
        lines = [log_prefix() + kv]
    else:
        s_gb = swa_tokens * bytes_per_token / 2 / 2**30
        lines = [log_prefix() + f"Use sliding window memory pool. full_layer_tokens={max_total_num_tokens}, "
                 f"swa_layer_tokens={swa_tokens}",
                 log_prefix() + "Full " + kv,
                 log_prefix() + f"SWA KV Cache is allocated. dtype: torch.bfloat16, #tokens: {swa_tokens}, "
                 f"K size: {s_gb:.2f} GB, V size: {s_gb:.2f} GB"]
    if max_total_num_tokens < context_len:
        lines.append(log_prefix() + f"KV pool holds {max_total_num_tokens} tokens, fewer than --context-length "
                     f"{context_len}. Requests are limited by the pool size.")
    lines.append(capacity_line(max_total_num_tokens=max_total_num_tokens, chunked_prefill_size=chunked_prefill_size,
                               max_prefill_tokens=max_prefill_tokens, max_running_requests=max_running_requests,
                               context_len=context_len))
    return lines


def serving_lines(host: str, port: int) -> list[str]:
    return [f"INFO:     Uvicorn running on http://{host}:{port} (Press CTRL+C to quit)",
            log_prefix() + "The server is fired up and ready to roll!"]


_RE_CAP = re.compile(r"max_total_num_tokens=(\d+)(?P<rest>[^\n]*)")
_RE_KV = re.compile(r"KV Cache is allocated\.[^\n]*?#tokens: (\d+)")


def _opt_int(rest: str, key: str) -> int | None:
    m = re.search(rf"\b{key}=(-?\d+|None)", rest)
    if not m or m.group(1) == "None" or int(m.group(1)) < 0:
        return None
    return int(m.group(1))


def parse_startup_log(text: str) -> ReportedCapacity:
    """Capacity line of every format seen (fixtures/sglang-startup-real-quotes.log): chunked_prefill_size,
    max_running_requests and available_*_mem optional; optional timestamp/rank prefix. Last line wins."""
    values: dict[str, object] = {}
    src: dict[str, str] = {}
    caps = list(_RE_CAP.finditer(text))
    if caps:
        m = caps[-1]
        rest = m.group("rest")
        values["kv_tokens"] = int(m.group(1))
        for field, key in (("max_model_len", "context_len"), ("max_running", "max_running_requests"),
                           ("token_budget", "chunked_prefill_size")):
            if (v := _opt_int(rest, key)) is not None:
                values[field] = v
        src = {k: "startup log: max_total_num_tokens line" for k in values}
    elif kvs := list(_RE_KV.finditer(text)):
        values["kv_tokens"] = int(kvs[-1].group(1))
        src["kv_tokens"] = "startup log: KV Cache is allocated"
    return ReportedCapacity(**values, sources=src)


def _gauge(families: dict, name: str) -> float | None:
    fam = families.get(name)
    return fam.samples[0].value if fam is not None and fam.samples else None


def reported_from_metrics(families: dict) -> ReportedCapacity:
    out = {}
    for field, name in (("kv_tokens", "sglang:max_total_num_tokens"), ("max_model_len", "sglang:context_len"),
                        ("block_size", "sglang:page_size")):
        if (v := _gauge(families, name)) is not None:
            out[field] = int(v)
    return ReportedCapacity(**out, sources={k: "metrics" for k in out})


def _published_flags(body: dict) -> dict[str, object]:
    """/server_info holds every server argument under its field name (ServerArgs.resolved_dict,
    server_args.py L316-333: the value after resolution, e.g. the GPU tier's chunked_prefill_size).
    None is a flag left unset; context_length stays None unless given (the model's own length is
    /v1/models' max_model_len), so an unset context_length is not published here."""
    flags = {}
    for name, flag in FLAGS.items():
        if name in ("api-key", "served-model-name") or flag.dest not in body:
            continue
        value = body[flag.dest]
        if value is None and name == "context-length":
            continue
        flags[name] = value
    return flags


# --- hybrid models (0.5.23): separate pools for full-attention layers, sliding-window layers (gpt-oss,
# Llama 4) and recurrent-state slots (Qwen3-Next); each has its gauges and its startup lines
# (checked against tests/engines/published/sglang-0.5.23-{gpt-oss-20b,qwen3-next}-*, recorded from the
# real shadow).
# Usage ratios, used / (total - 0) per pool (observability/metrics_collector.py L89-100, L404-427;
# computed in managers/scheduler_components/pool_stats_observer.py L56-163, L229-303): token_usage is
# the largest of the three. All three exist for every model; the other pools' stay 0.
HYBRID_METRICS = {
    "full_usage": "sglang:full_token_usage",  # L410-415
    "swa_usage": "sglang:swa_token_usage",  # L416-421
    "mamba_usage": "sglang:mamba_usage",  # L422-427: used state slots / the mamba pool's size
    "swa_used_tokens": "sglang:swa_used_tokens",  # L456-473
    "swa_available_tokens": "sglang:swa_available_tokens",
    "swa_evictable_tokens": "sglang:swa_evictable_tokens",
    "mamba_used_slots": "sglang:mamba_used_tokens",  # L474-491: state slots, despite the name
    "mamba_available_slots": "sglang:mamba_available_tokens",
    "mamba_evictable_slots": "sglang:mamba_evictable_tokens",
    # emitted once at startup, only for a hybrid-SWA pool (emit_constants L1769-1784; gauge L1295-1300)
    "swa_pool_tokens": "sglang:max_total_num_tokens_swa",
}
# Startup lines. The window pool: pool_configurator.py L888-891 — logged twice when --max-total-tokens
# caps the profiled pool (config_from_budget re-derives it), the last line is the pool.
_RE_SWA_POOL = re.compile(r"Use sliding window memory pool\. full_layer_tokens=(\d+), swa_layer_tokens=(\d+)")
# Each pool's buffers: "<label> KV Cache is allocated. dtype: D, #tokens: N, K size ..." with the
# allocation label "Full"/"SWA" on a hybrid-SWA pool, none otherwise (mem_cache/memory_pool.py L2077-2091).
_RE_POOL_ALLOC = re.compile(r"(?:(Full|SWA) )?KV Cache is allocated\. dtype: (\S+), #tokens: (\d+)")
# The recurrent-state pool (memory_pool.py L983-1010) and the cap it puts on max_running_requests
# (kv_cache_configurator.py L3135-3150; a WARNING, only when it binds).
_RE_MAMBA = re.compile(r"Mamba Cache is allocated\. max_mamba_cache_size: (\d+)")
_RE_MAMBA_CAP = re.compile(r"max_running_requests is capped to (\d+) by the mamba state cache "
                           r"\(max_mamba_cache_size=(\d+), (\d+) state slots per request\)")


def parse_hybrid_startup(text: str) -> dict[str, int | str]:
    """What SGLang's startup log says about a hybrid model's pools: full_tokens, swa_tokens (window
    pool), kv_dtype, mamba_slots, and when the state pool binds max_running_requests,
    mamba_capped_running and mamba_slots_per_request. Keys absent when the log does not say."""
    out: dict[str, int | str] = {}
    if swa := list(_RE_SWA_POOL.finditer(text)):
        out["full_tokens"], out["swa_tokens"] = int(swa[-1].group(1)), int(swa[-1].group(2))
    for m in _RE_POOL_ALLOC.finditer(text):
        label, dtype, tokens = m.group(1), m.group(2), int(m.group(3))
        out["kv_dtype"] = dtype
        out["swa_tokens" if label == "SWA" else "full_tokens"] = tokens  # the allocation has the last word
    if mamba := list(_RE_MAMBA.finditer(text)):
        out["mamba_slots"] = int(mamba[-1].group(1))
    if cap := list(_RE_MAMBA_CAP.finditer(text)):
        out["mamba_capped_running"], out["mamba_slots_per_request"] = int(cap[-1].group(1)), int(cap[-1].group(3))
    return out


def hybrid_gauges(families: dict) -> dict[str, float]:
    """HYBRID_METRICS' values from parsed /metrics families ({name: family}, prometheus_client;
    one rank: the first sample), by role; a gauge SGLang did not emit is left out."""
    return {role: v for role, name in HYBRID_METRICS.items() if (v := _gauge(families, name)) is not None}


def reported_from_info(path: str, body: dict) -> ReportedCapacity:
    if path == "/v1/models":
        # http_server.py L1993-2022: id = root = the served name, max_model_len = context_len
        data = (body.get("data") or [{}])[0]
        out = {"max_model_len": data.get("max_model_len"), "served_model_name": data.get("id")}
        out = {k: v for k, v in out.items() if v is not None}
        flags = {"context-length": out["max_model_len"]} if "max_model_len" in out else {}
        return ReportedCapacity(**out, flags=flags, sources={**{k: path for k in out},
                                                             **{f"flags.{k}": path for k in flags}})
    if path in ("/server_info", "/get_server_info"):
        states = body.get("internal_states") or [{}]
        cps = body.get("chunked_prefill_size")
        out = {"kv_tokens": body.get("max_total_num_tokens"), "max_req_input_len": body.get("max_req_input_len"),
               "max_model_len": body.get("context_length"), "block_size": body.get("page_size"),
               "max_running": states[0].get("effective_max_running_requests_per_dp"),
               "token_budget": cps if isinstance(cps, int) and cps > 0 else None, "version": body.get("version"),
               "served_model_name": body.get("served_model_name"), "model_path": body.get("model_path")}
        out = {k: v for k, v in out.items() if v is not None}
        flags = _published_flags(body)
        return ReportedCapacity(**out, flags=flags, sources={**{k: path for k in out},
                                                             **{f"flags.{k}": path for k in flags}})
    return ReportedCapacity()


# server_args.py prepare_server_args L679-695: argparse with prog "sglang serve", so an unknown flag
# ends the process with `sglang serve: error: unrecognized arguments: --bogus-flag 3`.
_RE_REFUSAL = re.compile(r"^.*?\bsglang serve: error: .*$", re.MULTILINE)


def startup_refusal_line(log_text: str) -> str | None:
    matches = _RE_REFUSAL.findall(log_text)
    return matches[-1].strip() if matches else None


# --- commands
def launch_command(model: str, flags: dict[str, object], *, host: str, port: int,
                   binary: list[str] | None = None, served_model_name: str | None = None) -> list[str]:
    """`python -m sglang.launch_server --model-path MODEL --host H --port P [--served-model-name NAME] ...`
    (launch_server.py). MODEL is loaded; clients send NAME, which defaults to MODEL
    (arg_groups/fields/serving.py served_model_name)."""
    flags = dict(flags)
    if served_model_name and served_model_name != model:
        flags["served-model-name"] = served_model_name
    return [*(binary or ["python", "-m", "sglang.launch_server"]), "--model-path", model, "--host", host,
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


def completion_body(prompt_ids: list[int], output_tokens: int, *, model: str | None,
                    stream: bool = True) -> dict:
    body: dict = {"prompt": list(prompt_ids), "max_tokens": output_tokens, "min_tokens": output_tokens,
                  "ignore_eos": True, "stream": stream}
    if model:
        body["model"] = model
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# --- errors (fixtures/errors.md, SGLang part)
def error_body(message: str, *, type: str = "BadRequestError", code: int = 400) -> dict:
    """/v1/completions: flat ErrorResponse (openai/serving_base.py create_error_response L205-221)."""
    return {"object": "error", "message": message, "type": type, "param": None, "code": code}


def generate_error_body(message: str) -> dict:
    """/generate: http_server.py `_create_error_response` L2246-2250."""
    return {"error": {"message": message}}


def streaming_abort_chunk(message: str) -> dict:
    """Scheduler-side abort while streaming /v1/completions: one SSE event, HTTP 200
    (create_streaming_error_response L223-238)."""
    return {"error": {"object": "error", "message": message, "type": "BAD_REQUEST", "param": None, "code": 400}}


def bad_request(message: str) -> dict:
    """Pydantic validation errors: 400 (not 422), type "Bad Request" (http_server.py L635-693)."""
    return error_body(message, type="Bad Request")


def check_tokenizer(prompt_len: int, max_new: int | None, min_new: int, context_len: int) -> str | None:
    """Tokenizer-side checks, in order (tokenizer_manager.py L1307-1378, sampling_params.py L280-294).
    A message means 400 before anything streams."""
    if prompt_len >= context_len:
        return f"The input ({prompt_len} tokens) is longer than the model's context length ({context_len} tokens)."
    if max_new is not None and prompt_len + max_new > context_len:
        return (f"Requested token count exceeds the model's maximum context length of {context_len} tokens. You "
                f"requested a total of {prompt_len + max_new} tokens: {prompt_len} tokens from the input messages "
                f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input messages "
                "or the completion to fit within the limit.")
    if max_new is not None and not 0 <= min_new <= max_new:
        return f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}."
    return None


def check_scheduler(prompt_len: int, max_req_input: int) -> str | None:
    """Scheduler-side check (managers/utils.py validate_input_length L259-289): an abort with status 400."""
    if prompt_len >= max_req_input:
        return (f"Input length ({prompt_len} tokens) exceeds the maximum allowed length ({max_req_input} tokens). "
                "Use a shorter input or enable --allow-auto-truncate.")
    return None


def clip_max_new(prompt_len: int, max_new: int, *, context_len: int, max_total_num_tokens: int,
                 page_size: int = 1) -> int:
    """Silent clipping (scheduler.py init_req_max_new_tokens L2693-2740, allocator max_new_tokens_for_memory)."""
    max_req_len = min(context_len - 1, max_total_num_tokens - 1)
    ceil_page = -(-prompt_len // page_size) * page_size
    return max(0, min(max_new, max_req_len - prompt_len - 1, max_total_num_tokens - ceil_page - page_size - 1))


# --- response shapes (openai/serving_completions.py, protocol.py)
def stream_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "matched_stop": None}], "usage": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def usage_chunk(rid: str, created: int, model: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_response(rid: str, created: int, model: str, text: str, finish_reason: str, prompt_tokens: int,
                        completion_tokens: int, version: str = DEFAULT_VERSION) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "matched_stop": None}], "usage": usage(prompt_tokens, completion_tokens)}


def generate_response(rid: str, text: str, output_ids: list[int], finish_reason: str, prompt_tokens: int,
                      e2e_latency: float, eos_id: int | None = None) -> dict:
    """Native /generate body (cumulative text; meta_info.finish_reason as a dict)."""
    reason = ({"type": "length", "length": len(output_ids)} if finish_reason == "length"
              else {"type": "stop", "matched": eos_id})
    return {"text": text, "output_ids": output_ids,
            "meta_info": {"id": rid, "finish_reason": reason, "prompt_tokens": prompt_tokens,
                          "completion_tokens": len(output_ids), "cached_tokens": 0, "e2e_latency": e2e_latency}}


def models_body(served: str, context_len: int, created: int) -> dict:
    """GET /v1/models (http_server.py L1993-2022)."""
    return {"object": "list", "data": [{"id": served, "object": "model", "created": created, "owned_by": "sglang",
                                        "root": served, "parent": None, "max_model_len": context_len}]}


def server_info_body(*, args: dict, max_total_num_tokens: int, max_req_input_len: int,
                     effective_max_running: int, version: str) -> dict:
    """GET /server_info (utils/common.py build_server_info L3584-3593): resolved args + scheduler info."""
    return {**args, "status": "ready", "max_total_num_tokens": max_total_num_tokens,
            "max_req_input_len": max_req_input_len, "version": version, "frontend": "python",
            "internal_states": [{"effective_max_running_requests_per_dp": effective_max_running,
                                 "last_gen_throughput": 0.0,
                                 "memory_usage": {"token_capacity": max_total_num_tokens}}]}

# sglang:num_running_reqs is published only at prefill batches — as the count *before* the
# newly admitted requests (PrefillStats.from_adder) — and every decode_log_interval (40) decode
# steps (observability/metrics_reporter.py L719–899, L901–1140, 0.5.23). It is a sample biased
# low, not a count per step, so the probe measures running from the client's streams instead.
RUNNING_GAUGE_EXACT = False

# Engine steps between a request's admission and its first streamed token: the prefill batch that
# admits it, then — overlap scheduling is on by default (event_loop_overlap, scheduler.py
# L2061–2135) — the next iteration, which processes that batch's result and sends the token.
FIRST_TOKEN_LEAD_STEPS = 2

# sglang:num_retracted_requests_total is a labelled Counter (observability/metrics_collector.py
# L557-562) whose child is created by `.labels(...).inc(n)` at the first retraction (L1519): until
# then the family has no series on /metrics. Absent before it appears means "none yet".
PREEMPTION_COUNTER_LAZY = True
REQUEST_CAP_FLAG = "max-running-requests"  # reported as effective_max_running_requests_per_dp (/server_info)
TOKEN_BUDGET_FLAG = "chunked-prefill-size"


def length_limit(reported: ReportedCapacity) -> tuple[int, int] | None:
    """(context_len, HTTP status of a request one token past it): the tokenizer manager refuses
    input + max_new_tokens > context_len with 400 (tokenizer_manager.py L1307–1378)."""
    return None if reported.max_model_len is None else (int(reported.max_model_len), 400)
