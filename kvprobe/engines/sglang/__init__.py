"""SGLang's dialect: everything kvprobe knows about how SGLang speaks, one module per concern.

Written for SGLang 0.5.23 (the PyPI wheel), with the 0.5.22 / 0.5.21 differences where they matter;
every fact carries the SGLang source file (and line) it comes from.

- `versions`: the releases kvprobe knows and the admission policy of each;
- `flags`: the command line (`server_args.py`), the shadow's environment and flags, the start commands;
- `http`: endpoints, the API key, the fixed-length request, error bodies, response shapes;
- `logs`: the start-up lines, what is read back from a real engine's log, the warnings a probe watches;
- `metrics`: /metrics family names, labels, buckets, the hybrid pools' gauges;
- `info`: /v1/models and /server_info read back;
- `limits`: the request limits, the tokenizer's and the scheduler's refusals.

`kvprobe.engines.get_dialect("sglang")` returns this package; callers read `dialect.METRICS`,
`dialect.capacity_line(...)`, ... from here, never from the modules.
"""

from __future__ import annotations

from kvprobe.engines.sglang.flags import (
    CPU_UNREGISTERED_QUANTIZATION,
    FLAG_ALIASES,
    FLAGS,
    LAUNCH_MODULE,
    OTHER_FLAGS,
    REQUEST_CAP_FLAG,
    SHADOW_ENV,
    SHADOW_FLAGS,
    STREAM_INTERVAL_FLAG,
    TOKEN_BUDGET_FLAG,
    emulator_command,
    launch_command,
)
from kvprobe.engines.sglang.http import (
    ALIVE_PATH,
    API_KEY_ENV,
    AUTH_EXEMPT_PREFIXES,
    COMPLETIONS_PATH,
    DEFAULT_PORT,
    FIRST_TOKEN_LEAD_STEPS,
    GENERATE_PATH,
    HEALTH_GENERATE_PATH,
    HEALTH_PATH,
    INFO_PATHS,
    METRICS_PATH,
    MODEL_INFO_PATHS,
    MODELS_PATH,
    SERVER_INFO_PATHS,
    UNAUTHORIZED_BODY,
    UNAUTHORIZED_STATUS,
    auth_required,
    bad_request,
    bearer_token,
    completion_body,
    completion_response,
    error_body,
    generate_error_body,
    generate_response,
    models_body,
    server_info_body,
    stream_chunk,
    streaming_abort_chunk,
    usage,
    usage_chunk,
)
from kvprobe.engines.sglang.info import (
    reported_from_info,
)
from kvprobe.engines.sglang.limits import (
    check_scheduler,
    check_tokenizer,
    clip_max_new,
    length_limit,
    max_req_input_len,
    resolve_max_running_requests,
)
from kvprobe.engines.sglang.logs import (
    LEAK_LOG,
    POOL_LINE,
    RETRACT_LOG,
    capacity_line,
    claim_lines,
    log_prefix,
    parse_hybrid_startup,
    parse_startup_log,
    serving_lines,
    startup_lines,
    startup_refusal_line,
)
from kvprobe.engines.sglang.metrics import (
    DECODE_LOG_INTERVAL,
    E2E_BUCKETS,
    HELP,
    HYBRID_METRICS,
    IDLE_REPORT_SECONDS,
    LABELS,
    METRICS,
    PREEMPTION_COUNTER_LAZY,
    RUNNING_GAUGE_EXACT,
    TOKENIZER_LABELS,
    TTFT_BUCKETS,
    hybrid_gauges,
    reported_from_metrics,
)
from kvprobe.engines.sglang.versions import (
    DEFAULT_VERSION,
    KNOWN_VERSIONS,
    NAME,
    policy,
    scheduler_rules,
)

__all__ = [
    "NAME", "DEFAULT_VERSION", "KNOWN_VERSIONS", "policy", "scheduler_rules", "SHADOW_ENV", "SHADOW_FLAGS", "FLAGS",
    "CPU_UNREGISTERED_QUANTIZATION", "OTHER_FLAGS", "FLAG_ALIASES", "REQUEST_CAP_FLAG", "TOKEN_BUDGET_FLAG",
    "STREAM_INTERVAL_FLAG",
    "LAUNCH_MODULE", "launch_command", "emulator_command", "DEFAULT_PORT", "HEALTH_PATH", "ALIVE_PATH",
    "MODELS_PATH", "METRICS_PATH", "SERVER_INFO_PATHS", "MODEL_INFO_PATHS", "GENERATE_PATH",
    "HEALTH_GENERATE_PATH", "INFO_PATHS", "COMPLETIONS_PATH", "API_KEY_ENV", "AUTH_EXEMPT_PREFIXES",
    "UNAUTHORIZED_STATUS", "UNAUTHORIZED_BODY", "auth_required", "bearer_token", "completion_body",
    "error_body", "generate_error_body", "streaming_abort_chunk", "bad_request", "stream_chunk", "usage",
    "usage_chunk", "completion_response", "generate_response", "models_body", "server_info_body",
    "FIRST_TOKEN_LEAD_STEPS", "RETRACT_LOG", "LEAK_LOG", "log_prefix", "capacity_line", "claim_lines", "startup_lines",
    "serving_lines", "POOL_LINE", "parse_startup_log", "parse_hybrid_startup", "startup_refusal_line", "LABELS",
    "TOKENIZER_LABELS", "METRICS", "DECODE_LOG_INTERVAL", "IDLE_REPORT_SECONDS", "TTFT_BUCKETS", "E2E_BUCKETS",
    "HELP", "reported_from_metrics", "HYBRID_METRICS", "hybrid_gauges", "RUNNING_GAUGE_EXACT",
    "PREEMPTION_COUNTER_LAZY", "reported_from_info", "max_req_input_len", "resolve_max_running_requests",
    "check_tokenizer", "check_scheduler", "clip_max_new", "length_limit",
]
