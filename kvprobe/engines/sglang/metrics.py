"""SGLang's /metrics (observability/metrics_collector.py, 0.5.23): family names, labels, buckets,
help texts, when the scheduler writes its gauges, and the hybrid pools' gauges."""

from __future__ import annotations

from kvprobe.engines.base import MetricMap, ReportedCapacity
from kvprobe.theory.sglang import reports

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

# Scheduler gauges are written at prefill batches, every decode_log_interval decode batches and on idle
# (metrics_reporter.py L719-1140, L1476-1520).
DECODE_LOG_INTERVAL = reports.DECODE_LOG_INTERVAL  # the engine's default (written once, in the theory)
# SGLang 0.5.23, srt/managers/scheduler_components/metrics_reporter.py `_maybe_log_idle_metrics`
# (called from every idle pass, scheduler.py `on_idle`): an idle scheduler republishes its gauges at
# once only when the running gauge disagrees with its running batch (`num_running_reqs.total !=
# len(running_batch.reqs)`); otherwise not before `last_log_time + 30` s. So when the last report
# before the load stopped already read 0 running (a prefill report counts the batch *before* its
# admissions), usage and the queue keep that report's values for up to 30 s after the engine is idle.
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


def hybrid_gauges(families: dict) -> dict[str, float]:
    """HYBRID_METRICS' values from parsed /metrics families ({name: family}, prometheus_client;
    one rank: the first sample), by role; a gauge SGLang did not emit is left out."""
    return {role: v for role, name in HYBRID_METRICS.items() if (v := _gauge(families, name)) is not None}


# sglang:num_running_reqs is published only at prefill batches — as the count *before* the
# newly admitted requests (PrefillStats.from_adder) — and every decode_log_interval (40) decode
# steps (observability/metrics_reporter.py L719–899, L901–1140, 0.5.23). It is a sample biased
# low, not a count per step, so the probe measures running from the client's streams instead.
RUNNING_GAUGE_EXACT = False

# sglang:num_retracted_requests_total is a labelled Counter (observability/metrics_collector.py
# L557-562) whose child is created by `.labels(...).inc(n)` at the first retraction (L1519): until
# then the family has no series on /metrics. Absent before it appears means "none yet".
PREEMPTION_COUNTER_LAZY = True
