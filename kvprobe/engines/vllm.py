"""vLLM's wire facts: flags, startup lines, metric names, error bodies, endpoint shapes.

Source: vLLM 0.33.0 (commit 4ba787ec9, PyPI wheel/sdist), with 0.11.0 / 0.9.2 differences where
they matter; file:line citations are from shared/reference/vllm.md and shared/fixtures/*.md.
Used by the emulator, the launcher, the sampler and the tests: a fact here is written once.
"""

from __future__ import annotations

import os
import re
import sys
import time

from kvprobe.engines.base import Flag, MetricMap, ReportedCapacity, render_flags
from kvprobe.errors import ConfigError
from kvprobe.theory.vllm.releases import policy as release_policy

NAME = "vllm"
DEFAULT_VERSION = "0.33.0"
DEFAULT_PORT = 8000  # entrypoints/common/cli_args.py L293-296
HEALTH_PATH = "/health"  # 200, empty body; 503 when the engine is dead (serve/instrumentator/health.py L22-33)
INFO_PATHS = ("/v1/models", "/version")
# With VLLM_SERVER_DEV_MODE=1 the server mounts /server_info (entrypoints/launchers/api_server/routers.py
# L46-49; serve/dev/server_info/api_router.py L43-60): the whole VllmConfig, scheduler limits included.
OPTIONAL_INFO_PATHS = ("/server_info?config_format=json",)
# Versions whose facts this module holds: 0.33.0 throughout; 0.11.0 and 0.9.2 where they differ
# (two-line capacity log, first-chunk admission, error bodies, gauge names).
KNOWN_VERSIONS = ("0.9.2", "0.11.0", "0.33.0")
COMPLETIONS_PATH = "/v1/completions"  # entrypoints/openai/completion/api_router.py

# --- metrics (v1/metrics/loggers.py, 0.33.0; exposition checked against fixtures/vllm-0.33.0-metrics.txt)
LABELS = ("model_name", "engine")  # loggers.py L499; engine = DP index "0"
METRICS = MetricMap(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    usage="vllm:kv_cache_usage_perc",
    usage_fallbacks=("vllm:gpu_cache_usage_perc",),  # renamed after 0.9.2, removed by 0.33.0
    waiting_capacity=("vllm:num_requests_waiting_by_reason", {"reason": "capacity"}),
    preemptions="vllm:num_preemptions",
    ttft="vllm:time_to_first_token_seconds",
    success="vllm:request_success",
    extra={
        "cache_config": "vllm:cache_config_info",
        "prefix_queries": "vllm:prefix_cache_queries",
        "prefix_hits": "vllm:prefix_cache_hits",
        "prompt_tokens": "vllm:prompt_tokens",
        "generation_tokens": "vllm:generation_tokens",
        "e2e": "vllm:e2e_request_latency_seconds",
        "sleep_state": "vllm:engine_sleep_state",
    },
)
WAITING_REASONS = ("capacity", "deferred")  # loggers.py L548
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # pre-created at 0, L808-819
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
# v1/metrics/buckets.py (0.33.0), as exposed in fixtures/vllm-0.33.0-metrics.txt
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
HELP = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:num_requests_waiting_by_reason": "Number of waiting requests by reason. Reason labels: 'capacity' = "
    "waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV "
    "transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
    "vllm:engine_sleep_state": "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine "
    "is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:request_success": "Count of successfully processed requests.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:cache_config_info": "Information of the LLMEngine CacheConfig",
}


def cache_config_labels(*, num_gpu_blocks: int, block_size: int, max_model_len: int, enable_prefix_caching: bool,
                        num_gpu_blocks_override: int | None, engine: str = "0",
                        user_specified_block_size: bool = False, gpu_memory_utilization: float = 0.92,
                        capacity: tuple[int, float] | None = None) -> dict[str, str]:
    """Labels of `vllm:cache_config_info` (loggers.py `log_metrics_info` L1114-1136): one per
    CacheConfig.__dict__ key, values as Python str(); no model_name label. Key set from the 0.33.0 fixture;
    user_specified_block_size is True when --block-size was given (config/cache.py L455-466). `capacity`:
    (kv tokens, max concurrency) of a hybrid model's groups (theory.vllm_kv.vllm_kv_plan), else one group's."""
    tokens, concurrency = capacity or capacity_numbers(num_gpu_blocks, block_size, max_model_len)
    labels = {
        "_block_size_resolved": "True", "block_size": str(block_size), "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None", "effective_attention_block_size": str(block_size),
        "enable_mamba_shared_prefix_checkpoint": "False", "enable_prefix_caching": str(bool(enable_prefix_caching)),
        "engine": engine, "gpu_memory_utilization": str(gpu_memory_utilization), "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None", "kv_cache_max_concurrency": str(concurrency),
        "kv_cache_memory_bytes": "None", "kv_cache_size_tokens": str(tokens), "kv_offloading_backend": "native",
        "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False", "mamba_block_size": "None",
        "mamba_cache_dtype": "auto", "mamba_cache_mode": "none", "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "auto", "num_cpu_blocks": "None", "num_gpu_blocks": str(num_gpu_blocks),
        "num_gpu_blocks_override": str(num_gpu_blocks_override), "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None", "replayssm_buffer_len": "16",
        "simple_cpu_offload_num_blocks": "None", "skip_page_size_padded": "None", "sliding_window": "None",
        "swa_bounded_replay": "True", "use_kda_recoverssm": "False", "use_replayssm": "False",
        "user_specified_block_size": str(bool(user_specified_block_size)),
    }
    return labels


# --- flags (engine/arg_utils.py::add_cli_args, 0.33.0). Defaults are the emulator's where the real one
# depends on the GPU (max-num-seqs / max-num-batched-tokens: the <70 GiB tier, 256 / 2048).
FLAGS: dict[str, Flag] = {f.name: f for f in (
    Flag("served-model-name", str, None, "name reported in /v1/models and the model_name label (L1031)"),
    Flag("num-gpu-blocks-override", int, None, "KV pool size in blocks, incl. the null block (L1398)", lo=1,
         ledger="num_gpu_blocks_override"),
    Flag("block-size", int, 16, "tokens per KV block (L1387)", lo=1, ledger="block_size"),
    Flag("max-model-len", int, 8192, "longest sequence (prompt + output); also -1/auto (L991)", kind="len", lo=1,
         ledger="max_model_len"),
    Flag("max-num-seqs", int, 256, "running-request cap (L1754)", lo=1, ledger="max_num_seqs"),
    Flag("max-num-batched-tokens", int, 2048, "per-step token budget, human units (L1740)", kind="count", lo=1,
         ledger="max_num_batched_tokens"),
    Flag("enable-prefix-caching", None, True, "hash full blocks for reuse (L1401-1407)", negatable=True,
         ledger="enable_prefix_caching"),
    Flag("enable-chunked-prefill", None, True, "split long prompts over steps", negatable=True),
    Flag("scheduler-reserve-full-isl", None, True, "admit only if the whole prompt fits (new after 0.11.0)",
         negatable=True, ledger="reserve_full_isl"),
    Flag("watermark", float, 0.0, "fraction of blocks kept free when admitting", lo=0),
    # None = the engine's default for the version and platform: async_scheduling_default() below.
    Flag("async-scheduling", None, None, "AsyncScheduler + batch queue of 2: allocate one step earlier, "
         "free one step later (config/scheduler.py L211; default: config/vllm.py L1685-1719)", negatable=True,
         ledger="async_scheduling"),
    # entrypoints/common/cli_args.py L335 (list[str], nargs "+"; the emulator takes one key per flag).
    # Secret: never printed by the emulator; prefer the VLLM_API_KEY environment variable, which keeps
    # the key out of the process list.
    Flag("api-key", str, None, "require `Authorization: Bearer KEY` on /v1/* (or env VLLM_API_KEY)"),
    # engine/arg_utils.py L630/L1920: no stat loggers -> no vllm:* families on /metrics (see below)
    Flag("disable-log-stats", None, False, "disable engine statistics (the vllm:* metric families)"),
    Flag("gpu-memory-utilization", float, 0.92, "fraction of GPU memory for vLLM (L1388)", emulated=False,
         kind="frac", ledger="gpu_memory_utilization"),
    Flag("kv-cache-memory-bytes", str, None, "KV pool in bytes, human units (L1394)", emulated=False,
         kind="bytes", lo=1, ledger="kv_cache_memory_bytes"),
    Flag("kv-cache-dtype", str, "auto", "KV cache dtype (L1397)", emulated=False, ledger="kv_cache_dtype"),
    Flag("dtype", str, "auto", "model dtype", emulated=False, ledger="dtype"),
    Flag("tensor-parallel-size", int, 1, "TP degree (L1209)", emulated=False, lo=1, ledger="tp"),
    Flag("pipeline-parallel-size", int, 1, "PP degree", emulated=False, lo=1, ledger="pp"),
    Flag("data-parallel-size", int, 1, "DP degree", emulated=False, lo=1, ledger="dp"),
)}
# Real vLLM flags kvprobe does not model: passed through to `vllm serve` as written, and listed so
# that an expectation's near-miss typo check does not refuse them.
OTHER_FLAGS = (
    "max-num-scheduled-tokens", "max-num-active-seqs", "long-prefill-token-threshold",
    "scheduling-policy", "prefill-schedule-interval", "max-num-queued-reqs",
    "max-num-queued-tokens", "enforce-eager", "disable-hybrid-kv-cache-manager",
    "performance-mode", "trust-remote-code", "quantization", "seed", "swap-space", "cpu-offload-gb",
    "disable-log-requests", "enable-log-requests", "tokenizer", "revision", "load-format",
    "stream-interval",  # arg_utils.py L1814: the API server streams every N tokens (the first at once)
)
FLAG_ALIASES = {"device-memory-utilization": "gpu-memory-utilization", "tp": "tensor-parallel-size"}


# --- running the real server on a CPU with a model-less worker (shared/reference/shadow-engines.md,
# verified with 0.33.0). VLLM_TARGET_DEVICE: DeviceConfig cannot infer a device otherwise;
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


# --- API key (entrypoints/serve/middleware/register.py L32-36, authenticate.py, 0.33.0): --api-key wins over
# VLLM_API_KEY (envs.py L829); only paths under these prefixes are guarded, OPTIONS never is; /health,
# /metrics, /version, /load stay open. Mismatch or a missing/non-Bearer header -> 401 with this body.
API_KEY_ENV = "VLLM_API_KEY"
AUTH_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
UNAUTHORIZED_STATUS = 401
UNAUTHORIZED_BODY = {"error": "Unauthorized"}


def auth_required(method: str, path: str) -> bool:
    """Does the AuthenticationMiddleware check this request (authenticate.py `__call__`)?"""
    return method != "OPTIONS" and path.startswith(AUTH_GUARDED_PREFIXES)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header (scheme case-insensitive, split at the
    first space, as authenticate.py `verify_token`); None when absent or another scheme."""
    if not authorization:
        return None
    scheme, _, param = authorization.partition(" ")
    return param if scheme.lower() == "bearer" else None


# --- --disable-log-stats (0.33.0): AsyncLLM builds no stat loggers (cli/serve.py L255/L321), so
# PrometheusStatLogger never registers its families (v1/metrics/loggers.py) -- neither the scheduler
# gauges nor vllm:cache_config_info. /metrics is still mounted (serve/instrumentator/metrics.py
# attach_router is unconditional) and serves the rest of the registry.
STATS_FAMILY_PREFIX = "vllm:"


def capacity_numbers(num_blocks: int, block_size: int, max_model_len: int) -> tuple[int, float]:
    """(kv tokens, max concurrency) as 0.33.0 logs them; theory owns the arithmetic."""
    from kvprobe.theory.vllm.budget import vllm_capacity_numbers

    return vllm_capacity_numbers(num_blocks, block_size, max_model_len)


def _vt(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def is_legacy(version: str) -> bool:
    """0.11.x and older: first-chunk admission, two-line capacity log, 400 for P + max_tokens > M."""
    return _vt(version) < (0, 12)


def policy(version: str, *, reserve_full_isl: bool = True) -> str:
    """The schedsim policy name for this version: the theory's release rule (theory/vllm/releases.py)."""
    return release_policy(version, reserve_full_isl=reserve_full_isl)


def async_scheduling_default(version: str = DEFAULT_VERSION, *, platform: str = "cuda") -> bool:
    """Whether `vllm serve` schedules asynchronously when --async-scheduling is not given.

    0.33.0: `SchedulerConfig.async_scheduling` defaults to None (config/scheduler.py L211) and
    `VllmConfig.__post_init__` turns it on unless the model pools, the executor cannot, or the V1
    runner is incompatible (config/vllm.py L1685-1719); the CPU platform forces it off
    (platforms/cpu.py L348). It arrived opt-in and experimental (vllm-project/vllm#19970, June
    2025; 0.11 has `--async-scheduling` off by default); the release that made it the default lies
    between 0.11 and 0.33 and is not pinned here: 0.12 and later are taken as on."""
    if platform == "cpu":
        return False
    return _vt(version) >= (0, 12)


def log_prefix(process: str, fileinfo: str, *, t: float | None = None, pid: int | None = None) -> str:
    """vllm.logger _FORMAT: `(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s
    [%(fileinfo)s:%(lineno)d] ` with date format `%m-%d %H:%M:%S` (fixtures/vllm-0.33.0-startup.md)."""
    stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(t))
    return f"({process} pid={pid if pid is not None else os.getpid()}) INFO {stamp} [{fileinfo}] "


def capacity_lines(num_blocks: int, block_size: int, max_model_len: int, version: str = DEFAULT_VERSION,
                   *, pid: int | None = None, t: float | None = None,
                   capacity: tuple[int, float] | None = None) -> list[str]:
    """The capacity line(s) as the engine prints them.

    0.33.0: one line, kv_cache_utils.py:1147 `update_kv_cache_capacity` (`capacity`: a hybrid model's
    figures, summed over its groups, L1061-1128).
    0.11.0 / 0.9.2: two lines (0.11.0 kv_cache_utils.py L1087 and L1091), tokens = num_blocks * block_size.
    """
    tokens, conc = capacity or capacity_numbers(num_blocks, block_size, max_model_len)
    if not is_legacy(version):
        pre = log_prefix("EngineCore", "kv_cache_utils.py:1147", t=t, pid=pid)
        return [pre + f"GPU KV cache size: {tokens:,} tokens, Maximum concurrency for "
                      f"{max_model_len:,} tokens per request: {conc:.2f}x"]
    legacy_tokens = num_blocks * block_size  # num_blocks // len(groups) * min_block_size, one group
    return [log_prefix("EngineCore_DP0", "kv_cache_utils.py:1087", t=t, pid=pid)
            + f"GPU KV cache size: {legacy_tokens:,} tokens",
            log_prefix("EngineCore_DP0", "kv_cache_utils.py:1091", t=t, pid=pid)
            + f"Maximum concurrency for {max_model_len:,} tokens per request: {conc:.2f}x"]


def startup_lines(*, num_blocks: int, block_size: int, max_model_len: int, max_num_batched_tokens: int,
                  version: str = DEFAULT_VERSION, pid: int | None = None,
                  capacity: tuple[int, float] | None = None) -> list[str]:
    """What the emulator prints before it serves: model.py:2170, scheduler.py:310, then the capacity line(s)."""
    return [
        log_prefix("APIServer", "model.py:2170", pid=pid) + f"Using max model len {max_model_len}",
        log_prefix("APIServer", "scheduler.py:310", pid=pid)
        + f"Chunked prefill is enabled with max_num_batched_tokens={max_num_batched_tokens}.",
        *capacity_lines(num_blocks, block_size, max_model_len, version, pid=pid, capacity=capacity),
    ]


def serving_line(host: str, port: int) -> str:
    """api_server startup line once the socket is bound."""
    return log_prefix("APIServer", "api_server.py:1989") + f"Starting vLLM API server 0 on http://{host}:{port}"


def startup_refusal(num_blocks: int, block_size: int, max_model_len: int,
                    bytes_per_token: int = 131072) -> str | None:
    """The ValueError text vLLM raises when one max_model_len request does not fit the usable blocks
    (kv_cache_planning._check_enough_kv_cache_memory L50-87: num_blocks - 1 >= cdiv(M, B)); theory
    holds the message. The emulator has no bytes: GiB figures use `bytes_per_token` (Llama-3.1-8B bf16)."""
    from kvprobe.errors import ConfigError as _Refused
    from kvprobe.theory.vllm.budget import vllm_check_fits

    per_block = bytes_per_token * block_size
    try:
        vllm_check_fits(num_blocks, per_block, block_size, max_model_len, num_blocks * per_block)
    except _Refused as err:
        return str(err)
    return None


STARTUP_FAILED = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
# Any other failed start: EngineCore logs its exception (v1/engine/core.py `run_engine_core`
# L1580-1588, "(EngineCore pid=N) ERROR ... [core.py:1584] ValueError: ...") and re-raises it, so its
# traceback ends with the same line; the API server then only echoes STARTUP_FAILED. The shadow
# worker's own refusals (a layer kind it cannot describe) take this path too.
_RE_EXCEPTION_LINE = re.compile(r"^(?:\(EngineCore[^)]*\) ERROR [^\]]*\] )?((?:\w+\.)*\w+(?:Error|Exception): .+)$",
                                re.M)


def _root_cause(text: str) -> str | None:
    """vLLM's last exception line that is not the API server's echo."""
    echo = STARTUP_FAILED.split(":", 1)[0] + ":"
    causes = [m.group(1).strip() for m in _RE_EXCEPTION_LINE.finditer(text) if not m.group(1).startswith(echo)]
    return causes[-1] if causes else None


# --- parsing what an engine says about itself
_RE_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_RE_CONC = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_RE_MAXLEN = re.compile(r"Using max model len (\d+)")
_RE_BUDGET = re.compile(r"max_num_batched_tokens=(\d+)")
_RE_OVERRIDE = re.compile(r"with num_gpu_blocks_override=(\d+)")
_RE_BLOCKS = re.compile(r"cache_config_info with initialization after num_gpu_blocks is: (\d+)")
_RE_AUTOFIT = re.compile(r"Auto-fit max_model_len: reduced from \d+ to (\d+)")


def _last(regex: re.Pattern, text: str) -> re.Match | None:
    matches = list(regex.finditer(text))
    return matches[-1] if matches else None


def parse_startup_log(text: str) -> ReportedCapacity:
    """Both capacity-line forms (0.33 one line, 0.11/0.9.2 two lines), plus the lines around them.
    The last occurrence wins (a log may hold several starts)."""
    values: dict[str, object] = {}
    src: dict[str, str] = {}

    def put(name, value, where):
        values[name], src[name] = value, f"startup log: {where}"

    if m := _last(_RE_TOKENS, text):
        put("kv_tokens", int(m.group(1).replace(",", "")), "KV cache size")
    if m := _last(_RE_CONC, text):
        put("max_model_len", int(m.group(1).replace(",", "")), "Maximum concurrency for")
        put("max_concurrency", float(m.group(2)), "Maximum concurrency")
    elif m := (_last(_RE_AUTOFIT, text) or _last(_RE_MAXLEN, text)):
        put("max_model_len", int(m.group(1)), "max model len")
    if m := _last(_RE_BUDGET, text):
        put("token_budget", int(m.group(1)), "Chunked prefill is enabled")
    if m := (_last(_RE_BLOCKS, text) or _last(_RE_OVERRIDE, text)):
        put("num_blocks", int(m.group(1)), "num_gpu_blocks")
    for name, value in parse_non_default_args(text).items():
        if name not in values:  # the engine's own resolved figures win over the arguments given
            put(name, value, "non-default args")
    return ReportedCapacity(**values, sources=src)


def _label_int(value: str | None) -> int | None:
    return None if value in (None, "None", "") else int(float(value))


def _label_float(value: str | None) -> float | None:
    return None if value in (None, "None", "") else float(value)


def _label_bool(value: str | None) -> bool | None:
    return None if value in (None, "None", "") else value == "True"


# `vllm:cache_config_info` label -> (flag, how the label's str() is read back). The labels are
# CacheConfig.__dict__ rendered with str() (config/cache.py `metrics_info`); the flags set them
# (engine/arg_utils.py create_engine_config: --block-size -> block_size, --kv-cache-dtype ->
# cache_dtype, ...). "None" is a flag that was not given. Checked against a real 0.33.0 server
# (tests/engines/published/vllm-0.33.0-cache_config_info.txt).
CACHE_CONFIG_FLAGS = {
    "block_size": ("block-size", _label_int),
    "num_gpu_blocks_override": ("num-gpu-blocks-override", _label_int),
    "gpu_memory_utilization": ("gpu-memory-utilization", _label_float),
    "kv_cache_memory_bytes": ("kv-cache-memory-bytes", _label_int),
    "cache_dtype": ("kv-cache-dtype", lambda v: None if v in (None, "None") else v),
    "enable_prefix_caching": ("enable-prefix-caching", _label_bool),
}


def reported_from_metrics(families: dict) -> ReportedCapacity:
    """From `vllm:cache_config_info` labels (0.33.0 has kv_cache_size_tokens / kv_cache_max_concurrency):
    the pool, and the cache flags the engine was started with."""
    fam = families.get("vllm:cache_config_info")
    if fam is None or not fam.samples:
        return ReportedCapacity()
    labels = fam.samples[0].labels
    src = "metrics: vllm:cache_config_info"
    blocks, bsize = _label_int(labels.get("num_gpu_blocks")), _label_int(labels.get("block_size"))
    tokens = _label_int(labels.get("kv_cache_size_tokens"))
    conc = labels.get("kv_cache_max_concurrency")
    out = {"num_blocks": blocks, "block_size": bsize, "kv_tokens": tokens,
           "max_concurrency": None if conc in (None, "None") else float(conc)}
    if tokens is None and blocks is not None and bsize is not None:
        out["kv_tokens"] = blocks * bsize  # pre-0.33 labels: the legacy log's definition
    flags = {flag: read(labels[label]) for label, (flag, read) in CACHE_CONFIG_FLAGS.items() if label in labels}
    sources = {k: src for k, v in out.items() if v is not None}
    sources.update({f"flags.{k}": src for k in flags})
    return ReportedCapacity(**out, flags=flags, sources=sources)


# Dev-mode /server_info?config_format=json: VllmConfig sections -> {field: flag}. The section fields
# are the EngineArgs the flags set (engine/arg_utils.py create_engine_config, 0.33.0); checked
# against a real 0.33.0 server (tests/engines/published/vllm-0.33.0-server_info.json).
SERVER_INFO_FLAGS = {
    "scheduler_config": {"max_num_seqs": "max-num-seqs", "max_num_batched_tokens": "max-num-batched-tokens",
                         "enable_chunked_prefill": "enable-chunked-prefill", "watermark": "watermark",
                         "scheduler_reserve_full_isl": "scheduler-reserve-full-isl",
                         # the API server's copy: on the CPU platform always false (platforms/cpu.py forces
                         # it off); kvprobe's shadow worker turns it back on inside EngineCore only
                         "async_scheduling": "async-scheduling"},
    "cache_config": {"block_size": "block-size", "num_gpu_blocks_override": "num-gpu-blocks-override",
                     "gpu_memory_utilization": "gpu-memory-utilization", "cache_dtype": "kv-cache-dtype",
                     "kv_cache_memory_bytes": "kv-cache-memory-bytes", "enable_prefix_caching": "enable-prefix-caching"},
    "parallel_config": {"tensor_parallel_size": "tensor-parallel-size",
                        "pipeline_parallel_size": "pipeline-parallel-size",
                        "data_parallel_size": "data-parallel-size"},
    "model_config": {"max_model_len": "max-model-len", "dtype": "dtype"},
}


DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # envs.py L1468: "1" mounts the dev routers, /server_info among them


def dev_server_info_body(*, max_num_seqs: int, max_num_batched_tokens: int, enable_chunked_prefill: bool,
                         watermark: float, reserve_full_isl: bool, block_size: int, num_gpu_blocks: int,
                         num_gpu_blocks_override: int | None, enable_prefix_caching: bool, max_model_len: int,
                         model: str, served_model_name: str, user_specified_block_size: bool,
                         gpu_memory_utilization: float = 0.92) -> dict:
    """GET /server_info?config_format=json in dev mode (serve/dev/server_info/api_router.py L43-60):
    `vllm_config` dumped by pydantic (mode json, str fallback), with the sections and fields kvprobe
    reads as a real 0.33.0 server writes them (tests/engines/published/vllm-0.33.0-server_info.json;
    the real dump has many more fields, and `vllm_env` / `system_env` beside it)."""
    return {"vllm_config": {
        "model_config": {"model": model, "tokenizer": model, "dtype": "torch.bfloat16", "max_model_len": max_model_len,
                         "served_model_name": served_model_name},
        "cache_config": {"block_size": block_size, "user_specified_block_size": user_specified_block_size,
                         "gpu_memory_utilization": gpu_memory_utilization, "cache_dtype": "auto",
                         "num_gpu_blocks_override": num_gpu_blocks_override,
                         "enable_prefix_caching": enable_prefix_caching, "num_gpu_blocks": num_gpu_blocks,
                         "kv_cache_memory_bytes": None},
        "parallel_config": {"pipeline_parallel_size": 1, "tensor_parallel_size": 1, "data_parallel_size": 1},
        "scheduler_config": {"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
                             "enable_chunked_prefill": enable_chunked_prefill, "policy": "fcfs",
                             "scheduler_reserve_full_isl": reserve_full_isl, "watermark": watermark,
                             "async_scheduling": False},
    }, "vllm_env": {}, "system_env": {}}


def _config_value(flag: str, value: object) -> object:
    if flag == "dtype" and isinstance(value, str):
        return value.removeprefix("torch.")  # ModelConfig.dtype is a torch.dtype, dumped with str()
    return value


def _from_server_info(body: dict, path: str) -> ReportedCapacity:
    config = body.get("vllm_config")
    if not isinstance(config, dict):  # config_format=text: one str(VllmConfig), nothing to read safely
        return ReportedCapacity()
    flags: dict[str, object] = {}
    for section, fields in SERVER_INFO_FLAGS.items():
        values = config.get(section) or {}
        for name, flag in fields.items():
            if name in values:
                flags[flag] = _config_value(flag, values[name])
    sched, model = config.get("scheduler_config") or {}, config.get("model_config") or {}
    out = {"max_running": sched.get("max_num_seqs"), "token_budget": sched.get("max_num_batched_tokens"),
           "max_model_len": model.get("max_model_len"), "served_model_name": model.get("served_model_name"),
           "model_path": model.get("model"), "num_blocks": (config.get("cache_config") or {}).get("num_gpu_blocks")}
    out = {k: v for k, v in out.items() if v is not None}
    if isinstance(out.get("served_model_name"), list):  # --served-model-name takes several names
        out["served_model_name"] = out["served_model_name"][0]
    return ReportedCapacity(**out, flags=flags,
                            sources={**{k: path for k in out}, **{f"flags.{k}": path for k in flags}})


def reported_from_info(path: str, body: dict) -> ReportedCapacity:
    if path == "/v1/models":
        # openai/models/serving.py show_available_models L64-77: id = the served name, root = the
        # model path, max_model_len = ModelConfig.max_model_len (the auto-fitted value included).
        data = (body.get("data") or [{}])[0]
        out = {"max_model_len": data.get("max_model_len"), "served_model_name": data.get("id"),
               "model_path": data.get("root")}
        out = {k: v for k, v in out.items() if v is not None}
        flags = {"max-model-len": out["max_model_len"]} if "max_model_len" in out else {}
        return ReportedCapacity(**out, flags=flags, sources={**{k: path for k in out},
                                                             **{f"flags.{k}": path for k in flags}})
    if path == "/version":
        v = body.get("version")
        return ReportedCapacity(version=v, sources={"version": "/version"} if v else {})
    if path.startswith("/server_info"):
        return _from_server_info(body, "/server_info")
    return ReportedCapacity()


# utils/argparse_utils.py FlexibleArgumentParser.error L182-195 -> argparse: `PROG: error: MESSAGE`
# (an unknown flag: "vllm serve: error: unrecognized arguments: --bogus-flag 3"); a pool too small for
# max_model_len raises the ValueError of kv_cache_planning._check_enough_kv_cache_memory L50-87.
_RE_REFUSAL = re.compile(r"^(?:.*?\b(?:vllm|serve): error: .*|.*ValueError: To serve at least one request.*)$",
                         re.MULTILINE)


def startup_refusal_line(log_text: str) -> str | None:
    matches = _RE_REFUSAL.findall(log_text)
    return matches[-1].strip() if matches else _root_cause(log_text)


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


def completion_body(prompt_ids: list[int], output_tokens: int, *, model: str | None,
                    stream: bool = True) -> dict:
    """The fixed-length request: ignore_eos, min_tokens = max_tokens = O."""
    body: dict = {"prompt": list(prompt_ids), "max_tokens": output_tokens, "min_tokens": output_tokens,
                  "ignore_eos": True, "stream": stream}
    if model:
        body["model"] = model
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# --- error bodies and length checks (entrypoints/serve/exception_handling/error_response.py L14-108)
def error_body(message: str, *, type: str = "BadRequestError", param: str | None = None, code: int = 400,
               version: str = DEFAULT_VERSION) -> dict:
    """Nested `{"error": {...}}` (0.11.0 and 0.33.0); flat `{"object": "error", ...}` in 0.9.2."""
    info = {"message": message, "type": type, "param": param, "code": code}
    if _vt(version) < (0, 10):
        return {"object": "error", **info}
    return {"error": info}


def check_lengths(prompt_len: int, max_tokens: int, min_tokens: int, max_model_len: int, *,
                  text_prompt: bool = False, version: str = DEFAULT_VERSION) -> tuple[int, dict | None]:
    """-> (effective max_tokens, error body or None). Order of completion/serving.py `_create_completion`
    L131-200 (0.33.0); messages as run in fixtures/errors.md."""
    m = max_model_len

    def err(msg, param=None, value=None):
        if param is not None:
            msg = f"{msg} (parameter={param}, value={value})"  # VLLMValidationError.__str__, exceptions.py L49-57
        return max_tokens, error_body(msg, param=param, version=version)

    if is_legacy(version):
        # 0.11.0 entrypoints/renderer.py L384-387 with max_length = max_model_len - max_tokens
        if prompt_len + max_tokens > m:
            return err(f"This model's maximum context length is {m - max_tokens} tokens. However, your request "
                       f"has {prompt_len} input tokens. Please reduce the length of the input messages.")
    else:
        if max_tokens > m:  # renderers/params.py L270-284
            return err(f"max_tokens={max_tokens} cannot be greater than max_model_len={m}. Please request fewer "
                       "output tokens.", "max_tokens", max_tokens)
        if prompt_len > m:  # params.py L531-552; text is tokenized with truncation to M+1 ("at least")
            shown = m + 1 if text_prompt else prompt_len
            at_least = "at least " if shown == m + 1 else ""
            return err(f"This model's maximum context length is {m} tokens. However, your prompt contains "
                       f"{at_least}{shown} input tokens, which exceeds this limit even without any output tokens. "
                       "Please reduce the length of the input prompt.", "input_tokens", shown)
        max_tokens = min(max_tokens, m - prompt_len)  # api_utils.get_max_tokens L234-270: silent clamp
    if max_tokens < 1:  # sampling_params.py L691-696
        return err(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if min_tokens > max_tokens:  # sampling_params.py L701-705: no parameter, param null
        return err(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    return max_tokens, None


def unknown_model_error(model: str, version: str = DEFAULT_VERSION) -> dict:
    """openai/models/serving.py L55-62: 404."""
    return error_body(f"The model `{model}` does not exist.", type="NotFoundError", param="model", code=404,
                      version=version)


def bad_request(message: str, version: str = DEFAULT_VERSION) -> dict:
    """Pydantic validation failures: 400 with type "Bad Request" (handlers/validation.py L149-195)."""
    return error_body(message, type="Bad Request", version=version)


MIN_TOKENS_NEGATIVE = "min_tokens must be greater than or equal to 0, got {}."  # sampling_params.py L697-699
STREAM_OPTIONS_ERROR = "Stream options can only be defined when `stream=True`."  # completion/protocol.py L599-610


# --- response shapes (completion/serving.py; non-stream body as run in fixtures/errors.md §4)
def stream_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "stop_reason": None}], "usage": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def usage_chunk(rid: str, created: int, model: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last chunk before `data: [DONE]` with include_usage: choices [] (serving.py L500-547)."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_response(rid: str, created: int, model: str, text: str, finish_reason: str, prompt_tokens: int,
                        completion_tokens: int, version: str = DEFAULT_VERSION) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                         "prompt_token_ids": None, "routed_experts": None, "weight_versions": None}],
            "service_tier": None, "system_fingerprint": f"vllm-{version}-emulated",
            "usage": {**usage(prompt_tokens, completion_tokens), "completion_tokens_details": None},
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def models_body(served: str, root: str, max_model_len: int, created: int) -> dict:
    """GET /v1/models (openai/models/serving.py::show_available_models L64-77)."""
    perm = {"id": f"modelperm-{created:x}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}
    return {"object": "list", "data": [{"id": served, "object": "model", "created": created, "owned_by": "vllm",
                                        "root": root, "parent": None, "max_model_len": max_model_len,
                                        "permission": [perm]}]}

# The running/waiting gauges are set from SchedulerStats built at the end of every
# update_from_output (v1/core/sched/scheduler.py L2660–2674, 0.33.0): a count after each step,
# so the probe can read the running plateau straight from them.
RUNNING_GAUGE_EXACT = True

# Engine steps between admission and the first streamed token: the step that schedules the whole
# prompt samples the first token (chunked prefill of a prompt within the token budget, sync view).
FIRST_TOKEN_LEAD_STEPS = 1

# vllm:num_preemptions: its per-engine child is created with the stat logger
# (create_metric_per_engine, v1/metrics/loggers.py L738-745), so it reads 0 from the start.
PREEMPTION_COUNTER_LAZY = False
REQUEST_CAP_FLAG = "max-num-seqs"  # engine/arg_utils.py L1754; scheduler.py caps len(running) by it
TOKEN_BUDGET_FLAG = "max-num-batched-tokens"  # engine/arg_utils.py L1740

# `vllm serve` logs the arguments that differ from its parser's defaults before the engine starts:
# `logger.info("non-default args: %s", redact_sensitive_args(non_default_args))`
# (entrypoints/common/startup.py L94-96, called from entrypoints/launchers/launcher.py L368),
# a Python dict repr: `non-default args: {'model_tag': '...', 'port': 8000, 'max_num_seqs': 16}`.
# max_num_seqs and max_num_batched_tokens default to None in the parser (resolved later per
# device), so they appear whenever they were given.
NON_DEFAULT_ARGS = "non-default args: "
_RE_NON_DEFAULT = re.compile(r"non-default args: (\{[^\n]*\})")
_NON_DEFAULT_FIELDS = {"max_num_seqs": "max_running", "max_num_batched_tokens": "token_budget",
                       "max_model_len": "max_model_len", "num_gpu_blocks_override": "num_blocks",
                       "block_size": "block_size"}


def non_default_args_line(args: dict[str, object], *, pid: int | None = None) -> str:
    """The start-up line as vLLM 0.33 prints it (for the emulator)."""
    return log_prefix("APIServer", "startup.py:96", pid=pid) + NON_DEFAULT_ARGS + repr(dict(args))


def parse_non_default_args(text: str) -> dict[str, int]:
    """{ReportedCapacity field: value} from the last `non-default args:` line; only integers are
    read (by key, with a regex: the dict may hold reprs that are not Python literals)."""
    m = _last(_RE_NON_DEFAULT, text)
    if m is None:
        return {}
    out = {}
    for key, name in _NON_DEFAULT_FIELDS.items():
        if v := re.search(rf"'{key}': (\d+)\b", m.group(1)):
            out[name] = int(v.group(1))
    return out


def length_limit(reported: ReportedCapacity) -> tuple[int, int] | None:
    """(max_model_len, HTTP status of a fixed-length request one token past it). 0.33 clamps
    max_tokens to max_model_len − P and then refuses min_tokens = O > max_tokens with 400
    (sampling_params.py L701–705); 0.11 refused P + max_tokens > max_model_len with 400 outright."""
    return None if reported.max_model_len is None else (int(reported.max_model_len), 400)
