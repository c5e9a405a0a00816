"""vLLM's /metrics (v1/metrics/loggers.py, 0.33.0): family names, labels, buckets, help texts, and
what `vllm:cache_config_info` says about the pool and the cache flags."""

from __future__ import annotations

from kvprobe.engines.base import MetricMap, ReportedCapacity
from kvprobe.engines.vllm.logs import capacity_numbers

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
# v1/metrics/buckets.py (0.33.0), as a real 0.33.0 server exposes them
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
    (kv tokens, max concurrency) of a hybrid model's groups (`vllm_kv_plan`,
    theory/vllm/hybrid/kv_cache_planning.py), else one group's."""
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



# --- --disable-log-stats (0.33.0): AsyncLLM builds no stat loggers (cli/serve.py L255/L321), so
# PrometheusStatLogger never registers its families (v1/metrics/loggers.py) -- neither the scheduler
# gauges nor vllm:cache_config_info. /metrics is still mounted (serve/instrumentator/metrics.py
# attach_router is unconditional) and serves the rest of the registry.
STATS_FAMILY_PREFIX = "vllm:"


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
    # Before 0.28.0 the labels carry no token figure, and none follows from them: the release's
    # "GPU KV cache size" is num_blocks // groups x the smallest block size through 0.20.0 and
    # int(max_concurrency x max_model_len) after (theory/vllm/releases.py KV_SIZE_LINE_FROM), and the
    # labels give neither the groups nor the concurrency (gpt-oss on 0.18.1: 400 blocks of 16 log 3,200
    # tokens, not 6,400). The start-up log's line, where it is read, is the figure.
    out = {"num_blocks": blocks, "block_size": bsize, "kv_tokens": tokens,
           "max_concurrency": None if conc in (None, "None") else float(conc)}
    flags = {flag: read(labels[label]) for label, (flag, read) in CACHE_CONFIG_FLAGS.items() if label in labels}
    sources = {k: src for k, v in out.items() if v is not None}
    sources.update({f"flags.{k}": src for k in flags})
    return ReportedCapacity(**out, flags=flags, sources=sources)


# The running/waiting gauges are set from SchedulerStats built at the end of every
# update_from_output (v1/core/sched/scheduler.py L2660–2674, 0.33.0): a count after each step,
# so the probe can read the running plateau straight from them.
RUNNING_GAUGE_EXACT = True

# vllm:num_preemptions: its per-engine child is created with the stat logger
# (create_metric_per_engine, v1/metrics/loggers.py L738-745), so it reads 0 from the start.
PREEMPTION_COUNTER_LAZY = False
