"""`kvprobe ledger`: print the capacity ledger of one engine configuration (theory only, no GPU)."""

from __future__ import annotations

import argparse
import json

from kvprobe.errors import ConfigError
from kvprobe.units import parse_bytes, parse_count

# flag -> LedgerInputs field for integer flags (vLLM human units accepted: 8k, 8K)
_COUNTS = {
    "block_size": "block_size", "page_size": "page_size", "max_model_len": "max_model_len",
    "context_length": "context_length", "max_num_seqs": "max_num_seqs",
    "max_running_requests": "max_running_requests", "max_num_batched_tokens": "max_num_batched_tokens",
    "chunked_prefill_size": "chunked_prefill_size", "tp": "tp", "pp": "pp", "dp": "dp",
    "num_gpu_blocks_override": "num_gpu_blocks_override", "max_total_tokens": "max_total_tokens",
    "prompt_tokens": "prompt_tokens", "output_tokens": "output_tokens", "users": "users",
    "shared_prefix_tokens": "shared_prefix_tokens",
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ledger", help="predict the KV pool and admission limit from config.json, GPU memory and flags",
        description=__doc__)
    p.add_argument("--engine", required=True, choices=("vllm", "sglang"))
    from kvprobe.theory.geometry import list_presets

    p.add_argument("--model", required=True,
                   help="a path to a config.json (or its dir), or a packaged preset: " + ", ".join(list_presets()))
    p.add_argument("--engine-version", help="engine version (defaults: vLLM 0.33.0, SGLang 0.5.23)")
    p.add_argument("--gpu-memory", help="memory of one GPU: 24GiB, 81559MiB, 80GB")
    p.add_argument("--gpu-memory-utilization", type=str, help="vLLM fraction (default per version)")
    p.add_argument("--mem-fraction-static", type=str, help="SGLang fraction (default: its formula)")
    p.add_argument("--dtype", help="model dtype override (bfloat16, float16, float32)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto, fp8, fp8_e4m3, fp8_e5m2, fp8_ds_mla, bfloat16, float16")
    p.add_argument("--max-model-len", help="vLLM; 'auto' or -1 fits the pool")
    for flag in ("block-size", "page-size", "context-length", "max-num-seqs", "max-running-requests",
                 "max-num-batched-tokens", "chunked-prefill-size", "num-gpu-blocks-override",
                 "max-total-tokens", "prompt-tokens", "output-tokens", "users"):
        p.add_argument(f"--{flag}")
    p.add_argument("--shared-prefix-tokens", metavar="K",
                   help="the first K prompt tokens are the same in every request (a system prompt)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM: schedule one step ahead (default: the engine version's, on a GPU)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM: prefix caching (default on)")
    p.add_argument("--disable-radix-cache", action="store_true", help="SGLang: no radix (prefix) cache")
    for flag in ("tp", "pp", "dp"):
        p.add_argument(f"--{flag}", default="1")
    p.add_argument("--kv-cache-memory-bytes", help="vLLM: KV bytes per GPU (replaces the profiled pool)")
    p.add_argument("--policy", help="admission policy (default: the engine version's)")
    p.add_argument("--estimate", action="append", default=[], metavar="NAME=BYTES",
                   help="override a vLLM non-KV estimate: activation_bytes, cudagraph_bytes, other_bytes")
    p.add_argument("--json", action="store_true", help="print the ledger as JSON")
    p.set_defaults(func=run)
    return p


def _fraction(text: str | None, key: str) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError as err:
        raise ConfigError(f"expected a fraction such as 0.9, got {text!r}", key=key) from err
    if not 0 < value <= 1:
        raise ConfigError(f"expected a fraction in (0, 1], got {text!r}", key=key)
    return value


def inputs_from_args(args: argparse.Namespace):
    from kvprobe.theory.ledger import LedgerInputs

    values = {}
    for attr, field in _COUNTS.items():
        text = getattr(args, attr)
        if text is None:
            continue
        flag = "--" + attr.replace("_", "-")
        if attr == "max_model_len" and str(text).strip() in ("auto", "-1"):
            values[field] = -1
            continue
        values[field] = parse_count(text, key=flag)
    estimates = {}
    for item in args.estimate:
        name, sep, size = item.partition("=")
        if not sep:
            raise ConfigError(f"expected NAME=BYTES, got {item!r}", key="--estimate")
        estimates[name.strip()] = parse_bytes(size, key=f"--estimate {name.strip()}")
    async_scheduling = args.async_scheduling
    if args.engine == "vllm" and async_scheduling is None:
        from kvprobe.engines import vllm

        async_scheduling = vllm.async_scheduling_default(args.engine_version or vllm.DEFAULT_VERSION)
    return LedgerInputs(
        engine=args.engine, model=args.model, engine_version=args.engine_version,
        async_scheduling=async_scheduling, enable_prefix_caching=args.enable_prefix_caching,
        disable_radix_cache=args.disable_radix_cache,
        gpu_memory_bytes=None if args.gpu_memory is None else parse_bytes(args.gpu_memory, key="--gpu-memory"),
        gpu_memory_utilization=_fraction(args.gpu_memory_utilization, "--gpu-memory-utilization"),
        mem_fraction_static=_fraction(args.mem_fraction_static, "--mem-fraction-static"),
        dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, policy=args.policy,
        kv_cache_memory_bytes=None if args.kv_cache_memory_bytes is None
        else parse_bytes(args.kv_cache_memory_bytes, key="--kv-cache-memory-bytes"),
        estimates=estimates, **values)


def run(args: argparse.Namespace) -> int:
    from kvprobe.theory.ledger import build_ledger

    ledger = build_ledger(inputs_from_args(args))
    if args.json:
        print(json.dumps(ledger.to_dict(), indent=2))
    else:
        print(ledger.render())
    return 0
