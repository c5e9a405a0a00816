"""kvprobe's hybrid pools against SGLang 0.5.23's own pool configurator, with no server and no GPU.

A real `KVCacheConfigurator` (mem_cache/kv_cache_configurator.py) is built from SGLang's own
ServerArgs and ModelConfig for each preset's config.json and sizes the pools from a byte budget;
kvprobe's `sglang_pools` must give the same full/window tokens, state slots and
max_running_requests, and SGLang's layer split. The SGLang environment is built by the shadow
target's tests; without it these are skipped (not installed from here).
"""

from __future__ import annotations

import pytest
from hybrid_engines import HERE, model_folder, run_json

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import geometry_from_config, load_model_config
from kvprobe.theory.sglang.pools import SglangOptions, sglang_layout, sglang_pools
from tests.engine_envs import engine_env

pytestmark = pytest.mark.slow
GIB = 2**30
NO_BUFFER = {"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True}
_OPTION_FIELDS = ("swa_full_tokens_ratio", "disable_hybrid_swa_memory", "max_mamba_cache_size",
                  "mamba_full_memory_ratio", "disable_radix_cache", "max_running_requests",
                  "chunked_prefill_size", "disable_overlap_schedule", "mamba_radix_cache_strategy")
CASES = [  # (preset, rest GiB, server args)
    ("openai/gpt-oss-20b", 40, {}),
    ("openai/gpt-oss-20b", 40, {"swa_full_tokens_ratio": 0.5}),
    ("openai/gpt-oss-20b", 40, {"max_total_tokens": 100000}),
    ("openai/gpt-oss-20b", 40, {"disable_radix_cache": True, "max_running_requests": 64,
                                "chunked_prefill_size": 8192}),
    ("openai/gpt-oss-20b", 0.004, {}),  # a window pool too small for one request
    ("openai/gpt-oss-120b", 40, {}),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 40, {}),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 40, {"disable_hybrid_swa_memory": True}),
    ("google/gemma-3-27b-it", 40, {}),
    ("mistralai/Mistral-7B-v0.1", 10, {}),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 40, NO_BUFFER),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 40, {**NO_BUFFER, "mamba_full_memory_ratio": 0.5}),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 40, {**NO_BUFFER, "max_mamba_cache_size": 100}),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 40, {"disable_radix_cache": True, "max_running_requests": 64}),
]


@pytest.fixture(scope="module")
def sglang_env(pytestconfig):
    return engine_env("sglang", "0.5.23", pytestconfig)


def _folder(tmp_path, name):
    cfg, _ = load_model_config(name)
    if cfg.get("quantization_config", {}).get("quant_method") == "mxfp4":
        # SGLang 0.5.23 registers mxfp4 only on CUDA/HIP/XPU or with SGLANG_USE_CPU_ENGINE=1
        # (layers/quantization/__init__.py L96-104), which then needs sgl_kernel; here it answers
        # "Unknown quantization method: mxfp4". The weights' format does not touch the KV pools.
        cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    return model_folder(tmp_path, name, cfg)


def _ours(name, rest_gb, args):
    cfg, _ = load_model_config(name)
    g = geometry_from_config(cfg, name)
    opts = SglangOptions(**{k: v for k, v in args.items() if k in _OPTION_FIELDS})
    return cfg, g, opts, lambda: sglang_pools(cfg, g, context_len=g.max_position_embeddings,
                                              rest_bytes=int(rest_gb * GIB),
                                              max_total_tokens=args.get("max_total_tokens"), opts=opts)


# Qwen3-Next with SGLang's defaults (no args): asked last, in the same run as CASES
DEFAULT_MAMBA = ("Qwen/Qwen3-Next-80B-A3B-Instruct", 40)


@pytest.fixture(scope="module")
def answered(sglang_env, tmp_path_factory):
    """SGLang's answers for every CASES entry, then for DEFAULT_MAMBA: one run of
    sglang_hybrid_facts.py (one import of SGLang)."""
    tmp = tmp_path_factory.mktemp("hybrid-sglang")
    folders = {name: _folder(tmp, name) for name, _, _ in CASES}
    answers = run_json(sglang_env, [str(HERE / "sglang_hybrid_facts.py")],
                       [{"model": folders[n], "rest_gb": r, "args": a} for n, r, a in CASES]
                       + [{"model": folders[DEFAULT_MAMBA[0]], "rest_gb": DEFAULT_MAMBA[1]}])
    assert len(answers) == len(CASES) + 1
    return answers[:-1], answers[-1]


def test_kvprobes_pools_are_sglangs_pools(answered):
    answers, _ = answered
    compared = refused = 0
    for (name, rest_gb, args), got in zip(CASES, answers, strict=True):
        what = f"{name} rest={rest_gb} GiB {args}"
        cfg, g, opts, pools = _ours(name, rest_gb, args)
        try:
            p = pools()
        except ConfigError as err:
            assert "error" in got, f"{what}: kvprobe refused ({err}), SGLang sized {got}"
            assert str(err).removeprefix(f"{err.key}: ") == got["error"], what
            refused += 1
            continue
        assert "error" not in got, f"{what}: SGLang refused: {got['error']}"
        lay = p.layout
        assert got["context_len"] == g.max_position_embeddings, what
        assert got["is_hybrid_swa"] == (lay.pool == "hybrid_swa"), what
        if lay.pool == "hybrid_swa":
            assert (tuple(got["swa_ids"]), tuple(got["full_ids"])) == (lay.swa_layer_ids, lay.full_layer_ids), what
            assert got["window"] == lay.sliding_window_size, what
        assert (p.max_total_num_tokens, p.swa_tokens, p.max_running_requests) == \
            (got["full"], got["swa"], got["mrr"]), what
        assert (p.mamba_slots, lay.mamba_cache_per_req or None) == (got["slots"], got["mamba_cache_per_req"]), what
        compared += 1
    print(f"{compared} pool splits identical to SGLang's, {refused} refusals with SGLang's message")
    assert (compared, refused) == (13, 1)


def test_sglangs_default_mamba_strategy_cannot_run_on_this_cpu(answered):
    """On a GPU Qwen3-Next defaults to the extra_buffer strategy (3 + 2 state slots per request,
    kvprobe's default); SGLang's CPU platform refuses it at argument resolution, so the shadow
    target must run `--mamba-radix-cache-strategy no_buffer --disable-overlap-schedule` (or
    without the radix cache)."""
    _, got = answered
    assert got == {"error": "extra_buffer requires platform support for Mamba cache state snapshots."}
    cfg, g, _, _ = _ours("Qwen/Qwen3-Next-80B-A3B-Instruct", 40, {})
    assert sglang_layout(cfg, g).pool == "mamba"
