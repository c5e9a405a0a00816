"""Run inside a vLLM engine environment: build vLLM's own EngineCore for one or more `vllm serve`
command lines (the shadow target's, with kvprobe's worker) and report what its KV planner decided,
with each KV cache group's spec (hybrid models: the window of a SlidingWindowSpec, the chunk of a
ChunkedLocalAttentionSpec, the layer count). Run through tests/vllm_plans.py.

Reads JSON from stdin: [{"argv": [...vllm serve arguments after the model...], "model": FOLDER,
"env": {...}}, ...]; prints one JSON line per case: the pool vLLM planned (num_gpu_blocks, the
capacity line's tokens and concurrency, the block size), or vLLM's own error message.

This is EngineCore.__init__ (v1/engine/core.py L121-250, 0.33.0) run in-process with the `uni`
executor, as `vllm serve` runs it in its EngineCore child: the config goes through the same CLI
parser (`EngineArgs.add_cli_args` / `from_cli_args`) and the CPU platform's
`check_and_update_config`; the planner is `_initialize_kv_caches`.
"""

import json
import os
import sys


def plan(case: dict) -> dict:
    os.environ.update(case.get("env", {}))
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor import Executor

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", case["model"], *case["argv"]])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    core = EngineCore(config, Executor.get_class(config), log_stats=False)
    try:
        cc = config.cache_config
        tokens, concurrency = _capacity(config, core.scheduler.kv_cache_config)
        return {"num_blocks": cc.num_gpu_blocks, "block_size": cc.block_size,
                "kv_tokens": tokens, "max_concurrency": concurrency,
                "max_model_len": config.model_config.max_model_len,
                "scheduler": type(core.scheduler).__name__,
                "groups": [type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups],
                "group_detail": [{"spec": type(g.kv_cache_spec).__name__, "layers": len(g.layer_names),
                                  "window": getattr(g.kv_cache_spec, "sliding_window", None)
                                  or getattr(g.kv_cache_spec, "attention_chunk_size", None),
                                  "block_size": g.kv_cache_spec.block_size,
                                  "page_size_bytes": g.kv_cache_spec.page_size_bytes}
                                 for g in core.scheduler.kv_cache_config.kv_cache_groups],
                "max_num_seqs": config.scheduler_config.max_num_seqs,
                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
                "prefix_caching": config.cache_config.enable_prefix_caching,
                "async_scheduling": config.scheduler_config.async_scheduling}
    finally:
        core.shutdown()


def _capacity(config, kv_cache_config) -> tuple[int, float]:
    """The capacity line's tokens and concurrency: the figures 0.33.0 keeps on the cache config
    (kv_cache_utils.py L1141), or, on releases that only log them (0.18.1-0.24.x: `_report_kv_cache_config`,
    kv_cache_utils.py L1294-1320 in 0.18.1, L1684-1713 in 0.20.2), what the release's own function logs: it
    is called with its module's logger swapped for one that records (info_once would say it once a process)."""
    cc = config.cache_config
    if getattr(cc, "kv_cache_size_tokens", None) is not None:
        return cc.kv_cache_size_tokens, cc.kv_cache_max_concurrency
    from vllm.v1.core import kv_cache_utils

    said: dict[str, tuple] = {}

    class Recorder:
        def info_once(self, msg, *args, **_):
            said[msg] = args

        info = debug = warning = info_once

    logger, kv_cache_utils.logger = kv_cache_utils.logger, Recorder()
    try:
        kv_cache_utils._report_kv_cache_config(config, kv_cache_config)
    finally:
        kv_cache_utils.logger = logger
    tokens = int(said["GPU KV cache size: %s tokens"][0].replace(",", ""))
    return tokens, kv_cache_utils.get_max_concurrency_for_kv_cache_config(config, kv_cache_config)


def main() -> None:
    for case in json.load(sys.stdin):
        try:
            out = plan(case)
        except Exception as err:  # noqa: BLE001 - vLLM's own refusal is the answer for that case
            out = {"error": f"{type(err).__name__}: {err}"}
        print("PLAN " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
