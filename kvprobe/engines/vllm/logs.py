"""vLLM's start-up log (0.33.0; 0.11.0 / 0.9.2 where they differ): the lines the emulator prints,
and what kvprobe reads back from a real engine's log (the pool, the limits, why it refused to start)."""

from __future__ import annotations

import os
import re
import time

from kvprobe.engines.base import ReportedCapacity
from kvprobe.engines.vllm.versions import DEFAULT_VERSION, two_line_capacity_log
from kvprobe.errors import ConfigError
from kvprobe.theory.vllm.budget import vllm_capacity_numbers, vllm_check_fits

# The capacity line's own name for the pool (kv_cache_utils.py `update_kv_cache_capacity`, 0.33.0).
POOL_LINE = "GPU KV cache size"


def capacity_numbers(num_blocks: int, block_size: int, max_model_len: int,
                     version: str = DEFAULT_VERSION) -> tuple[int, float]:
    """(kv tokens, max concurrency) as `version` logs them; theory owns the arithmetic."""
    return vllm_capacity_numbers(num_blocks, block_size, max_model_len, version)


def log_prefix(process: str, fileinfo: str, *, t: float | None = None, pid: int | None = None) -> str:
    """vllm.logger _FORMAT: `(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s
    [%(fileinfo)s:%(lineno)d] ` with date format `%m-%d %H:%M:%S` (vllm/logger.py, 0.33.0)."""
    stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(t))
    return f"({process} pid={pid if pid is not None else os.getpid()}) INFO {stamp} [{fileinfo}] "


def capacity_lines(num_blocks: int, block_size: int, max_model_len: int, version: str = DEFAULT_VERSION,
                   *, pid: int | None = None, t: float | None = None,
                   capacity: tuple[int, float] | None = None) -> list[str]:
    """The capacity line(s) as the engine prints them.

    0.28.0 and later: one line, kv_cache_utils.py:1147 `update_kv_cache_capacity` (`capacity`: a hybrid
    model's figures, summed over its groups, L1061-1128).
    0.27.x and older: two lines (`versions.two_line_capacity_log`); through 0.20.0 the tokens are
    num_blocks // groups x the smallest block size (0.11.0 kv_cache_utils.py L1087 and L1091; 0.18.1
    L1299-1303; theory/vllm/releases.py KV_SIZE_LINE_FROM), the ledger's `capacity` when given.
    """
    messages = capacity_messages(num_blocks, block_size, max_model_len, version, capacity=capacity)
    if not two_line_capacity_log(version):
        return [log_prefix("EngineCore", "kv_cache_utils.py:1147", t=t, pid=pid) + messages[0]]
    return [log_prefix("EngineCore_DP0", "kv_cache_utils.py:1087", t=t, pid=pid) + messages[0],
            log_prefix("EngineCore_DP0", "kv_cache_utils.py:1091", t=t, pid=pid) + messages[1]]


def capacity_messages(num_blocks: int, block_size: int, max_model_len: int, version: str = DEFAULT_VERSION,
                      *, capacity: tuple[int, float] | None = None) -> list[str]:
    """The capacity line(s) without their log prefix: what `capacity_lines` prints, and what the
    ledger shows as the engine's own figures."""
    tokens, conc = capacity or capacity_numbers(num_blocks, block_size, max_model_len, version)
    if not two_line_capacity_log(version):
        return [f"GPU KV cache size: {tokens:,} tokens, Maximum concurrency for "
                f"{max_model_len:,} tokens per request: {conc:.2f}x"]
    return [f"GPU KV cache size: {tokens:,} tokens",
            f"Maximum concurrency for {max_model_len:,} tokens per request: {conc:.2f}x"]


def claim_lines(cap: dict, version: str = DEFAULT_VERSION) -> list[str]:
    """What the engine will say about its pool, given the ledger's capacity (`Capacity` as a dict):
    the capacity line(s) of `version`, and the `vllm:cache_config_info` labels that carry the pool
    (0.28.0 adds kv_cache_size_tokens and kv_cache_max_concurrency; older releases are shown with
    num_gpu_blocks and block_size, the labels kvprobe reads there)."""
    lines = capacity_messages(cap["num_blocks"], cap["block_size"], cap["max_model_len"], version,
                              capacity=(cap["kv_tokens"], cap["max_concurrency_at_max_model_len"]))
    labels = f'num_gpu_blocks="{cap["num_blocks"]}",block_size="{cap["block_size"]}"'
    if not two_line_capacity_log(version):
        labels += (f',kv_cache_size_tokens="{cap["kv_tokens"]}",'
                   f'kv_cache_max_concurrency="{cap["max_concurrency_at_max_model_len"]:.2f}"')
    return [*lines, f"vllm:cache_config_info{{{labels},...}} 1.0"]


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
    per_block = bytes_per_token * block_size
    try:
        vllm_check_fits(num_blocks, per_block, block_size, max_model_len, num_blocks * per_block)
    except ConfigError as err:
        return str(err)
    return None


STARTUP_FAILED = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
# Any other failed start: EngineCore logs its exception (v1/engine/core.py `run_engine_core`
# L1580-1588, "(EngineCore pid=N) ERROR ... [core.py:1584] ValueError: ...") and re-raises it, so its
# traceback ends with the same line; the API server then only echoes STARTUP_FAILED. The shadow
# worker's own refusals (a layer kind it cannot describe) take this path too. With TP/PP > 1 the root
# cause is raised in a worker process, which logs it before the engine core sees it
# (v1/executor/multiproc_executor.py WorkerProc.worker_main `logger.exception("WorkerProc failed to
# start.")`, L1057 in 0.33.0, L857 in 0.19.0 as its log prints): vllm/logger.py's formatter puts the
# record's header on every traceback line, "(Worker pid=N) ERROR ... [...multiproc_executor.py:857]
# ValueError: Free memory on device ...". A chained exception ends with vLLM's own error, which names
# what to change ("RuntimeError: CUDA out of memory occurred when warming up sampler ...",
# v1/worker/gpu_model_runner.py _dummy_sampler_run): the last line wins.
_RE_EXCEPTION_LINE = re.compile(r"^(?:\((?:EngineCore|Worker)[^)]*\) ERROR [^\]]*\] )?"
                                r"((?:\w+\.)*\w+(?:Error|Exception): .+)$", re.M)


def _root_cause(text: str) -> str | None:
    """vLLM's last exception line that is not the API server's echo (a RuntimeError too, with its own text)."""
    echo = STARTUP_FAILED.split(".", 1)[0]
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


# utils/argparse_utils.py FlexibleArgumentParser.error L182-195 -> argparse: `PROG: error: MESSAGE`
# (an unknown flag: "vllm serve: error: unrecognized arguments: --bogus-flag 3"); a pool too small for
# max_model_len raises the ValueError of kv_cache_planning._check_enough_kv_cache_memory L50-87.
_RE_REFUSAL = re.compile(r"^(?:.*?\b(?:vllm|serve): error: .*|.*ValueError: To serve at least one request.*)$",
                         re.MULTILINE)


def startup_refusal_line(log_text: str) -> str | None:
    matches = _RE_REFUSAL.findall(log_text)
    return matches[-1].strip() if matches else _root_cause(log_text)


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
