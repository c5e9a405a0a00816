"""vLLM's dialect: everything kvprobe knows about how vLLM speaks, one module per concern.

Written for vLLM 0.33.0 (commit 4ba787ec9, the PyPI wheel), with the 0.11.0 / 0.9.2 differences
where they matter; every fact carries the vLLM source file (and line) it comes from.

- `versions`: the releases kvprobe knows and what changes between them;
- `flags`: the command line (`engine/arg_utils.py`), the shadow's environment, the start commands;
- `http`: endpoints, the API key, the fixed-length request, error bodies, response shapes;
- `logs`: the start-up lines, and what is read back from a real engine's log;
- `metrics`: /metrics family names, labels, buckets, and `vllm:cache_config_info`;
- `info`: /v1/models, /version and the dev-mode /server_info.

`kvprobe.engines.get_dialect("vllm")` returns this package; callers read `dialect.METRICS`,
`dialect.capacity_lines(...)`, ... from here, never from the modules.
"""

from __future__ import annotations

from kvprobe.engines.vllm.flags import (
    CPU_POOL_ENV,
    FLAG_ALIASES,
    FLAGS,
    OTHER_FLAGS,
    REQUEST_CAP_FLAG,
    SHADOW_ENV,
    STREAM_INTERVAL_FLAG,
    TOKEN_BUDGET_FLAG,
    emulator_command,
    launch_command,
)
from kvprobe.engines.vllm.http import (
    API_KEY_ENV,
    AUTH_GUARDED_PREFIXES,
    COMPLETIONS_PATH,
    DEFAULT_PORT,
    FIRST_TOKEN_LEAD_STEPS,
    HEALTH_PATH,
    INFO_PATHS,
    LOAD_PATH,
    METRICS_PATH,
    MIN_TOKENS_NEGATIVE,
    MODELS_PATH,
    OPTIONAL_INFO_PATHS,
    SERVER_INFO_PATH,
    STREAM_OPTIONS_ERROR,
    UNAUTHORIZED_BODY,
    UNAUTHORIZED_STATUS,
    VERSION_PATH,
    auth_required,
    bad_request,
    bearer_token,
    check_lengths,
    completion_body,
    completion_response,
    error_body,
    length_limit,
    models_body,
    stream_chunk,
    unknown_model_error,
    usage,
    usage_chunk,
)
from kvprobe.engines.vllm.info import (
    DEV_MODE_ENV,
    SERVER_INFO_FLAGS,
    dev_server_info_body,
    reported_from_info,
)
from kvprobe.engines.vllm.logs import (
    NON_DEFAULT_ARGS,
    POOL_LINE,
    STARTUP_FAILED,
    capacity_lines,
    capacity_messages,
    capacity_numbers,
    claim_lines,
    log_prefix,
    non_default_args_line,
    parse_non_default_args,
    parse_startup_log,
    serving_line,
    startup_lines,
    startup_refusal,
    startup_refusal_line,
)
from kvprobe.engines.vllm.metrics import (
    CACHE_CONFIG_FLAGS,
    E2E_BUCKETS,
    FINISHED_REASONS,
    HELP,
    LABELS,
    METRICS,
    PREEMPTION_COUNTER_LAZY,
    RUNNING_GAUGE_EXACT,
    SLEEP_STATES,
    STATS_FAMILY_PREFIX,
    TTFT_BUCKETS,
    WAITING_REASONS,
    cache_config_labels,
    reported_from_metrics,
)
from kvprobe.engines.vllm.versions import (
    DEFAULT_VERSION,
    KNOWN_VERSIONS,
    NAME,
    async_scheduling_default,
    is_legacy,
    policy,
)

__all__ = [
    "NAME", "DEFAULT_VERSION", "KNOWN_VERSIONS", "is_legacy", "policy", "async_scheduling_default", "FLAGS",
    "OTHER_FLAGS", "FLAG_ALIASES", "SHADOW_ENV", "CPU_POOL_ENV", "REQUEST_CAP_FLAG", "TOKEN_BUDGET_FLAG",
    "STREAM_INTERVAL_FLAG",
    "launch_command", "emulator_command", "DEFAULT_PORT", "HEALTH_PATH", "MODELS_PATH", "VERSION_PATH",
    "LOAD_PATH", "METRICS_PATH", "SERVER_INFO_PATH", "INFO_PATHS", "OPTIONAL_INFO_PATHS", "COMPLETIONS_PATH",
    "API_KEY_ENV", "AUTH_GUARDED_PREFIXES", "UNAUTHORIZED_STATUS", "UNAUTHORIZED_BODY", "auth_required",
    "bearer_token", "completion_body", "error_body", "check_lengths", "unknown_model_error", "bad_request",
    "MIN_TOKENS_NEGATIVE", "STREAM_OPTIONS_ERROR", "stream_chunk", "usage", "usage_chunk",
    "completion_response", "models_body", "FIRST_TOKEN_LEAD_STEPS", "length_limit", "capacity_numbers",
    "log_prefix", "capacity_lines", "capacity_messages", "claim_lines", "startup_lines", "serving_line",
    "startup_refusal", "STARTUP_FAILED",
    "parse_startup_log", "POOL_LINE", "startup_refusal_line", "NON_DEFAULT_ARGS", "non_default_args_line",
    "parse_non_default_args", "LABELS", "METRICS", "WAITING_REASONS", "FINISHED_REASONS", "SLEEP_STATES",
    "TTFT_BUCKETS", "E2E_BUCKETS", "HELP", "cache_config_labels", "STATS_FAMILY_PREFIX", "CACHE_CONFIG_FLAGS",
    "reported_from_metrics", "RUNNING_GAUGE_EXACT", "PREEMPTION_COUNTER_LAZY", "SERVER_INFO_FLAGS",
    "DEV_MODE_ENV", "dev_server_info_body", "reported_from_info",
]
