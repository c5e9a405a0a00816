"""SGLang's log (0.5.23): the start-up lines the emulator prints, what kvprobe reads back from a
real engine's log (the pool, the limits, a hybrid model's pools, why it refused to start), and the
warnings a probe watches for."""

from __future__ import annotations

import re
import time

from kvprobe.engines.base import ReportedCapacity
from kvprobe.theory.sglang.releases import MAX_PREFILL_TOKENS

# Retraction (check_decode_mem fails -> retract_decode): a WARNING line per retraction, and the labelled
# counter sglang:num_retracted_requests_total, which does not exist before the first retraction —
# absent is neither an error nor a zero (scheduler.py L4520-4530).
RETRACT_LOG = "KV cache pool is full. Retract requests."
# SGLang's own pool check whenever the scheduler is idle (scheduler.py on_idle L5281-5307,
# invariant_checker.py L452-459 `_report_leak`): strict by default (environ.py L502
# SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE), so a leaked token raises in the scheduler and the server
# dies; not strict, it logs this.
LEAK_LOG = "memory leak detected!"


# --- startup lines: `[%Y-%m-%d %H:%M:%S{prefix}] message` (utils/common.py configure_logger L2618-2638);
# the ` TPn` part appears only with TP > 1.
def log_prefix(t: float | None = None) -> str:
    return "[" + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + "] "


# The capacity line's own name for the pool (managers/scheduler.py L1267-1276, 0.5.23).
POOL_LINE = "max_total_num_tokens"


def capacity_line(*, max_total_num_tokens: int, chunked_prefill_size: int, max_prefill_tokens: int,
                  max_running_requests: int, context_len: int, available_gpu_mem: float = 0.0) -> str:
    """managers/scheduler.py L1267-1276 (TP rank 0)."""
    return (log_prefix() + f"max_total_num_tokens={max_total_num_tokens}, chunked_prefill_size={chunked_prefill_size}, "
            f"max_prefill_tokens={max_prefill_tokens}, max_running_requests={max_running_requests}, "
            f"context_len={context_len}, available_gpu_mem={available_gpu_mem:.2f} GB")


def claim_lines(cap: dict, version: str | None = None, *, max_prefill_tokens: int = MAX_PREFILL_TOKENS) -> list[str]:
    """What the engine will say about its pool, given the ledger's capacity (`Capacity` as a dict):
    the capacity line (its GPU-memory tail is the run's and is left out) and the two figures of
    /server_info (`max_total_num_tokens`, `internal_states[0].effective_max_running_requests_per_dp`,
    http_server.py `get_server_info`). The wording is 0.5.23's; the release is not read."""
    line = capacity_line(max_total_num_tokens=cap["kv_tokens"], chunked_prefill_size=cap["token_budget"],
                         max_prefill_tokens=max_prefill_tokens,
                         max_running_requests=cap["max_running"], context_len=cap["max_model_len"])
    message = line[len(log_prefix()):].rsplit(", available_gpu_mem=", 1)[0] + ", available_gpu_mem=..."
    return [message, f'/server_info: "max_total_num_tokens": {cap["kv_tokens"]}, '
                     f'"effective_max_running_requests_per_dp": {cap["max_running"]}']


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
    """Capacity line of every format seen in real logs: chunked_prefill_size,
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


# server_args.py prepare_server_args L679-695: argparse with prog "sglang serve", so an unknown flag
# ends the process with `sglang serve: error: unrecognized arguments: --bogus-flag 3`.
_RE_REFUSAL = re.compile(r"^.*?\bsglang serve: error: .*$", re.MULTILINE)


def startup_refusal_line(log_text: str) -> str | None:
    matches = _RE_REFUSAL.findall(log_text)
    return matches[-1].strip() if matches else None
