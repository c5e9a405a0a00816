"""SGLang 0.5.23's hybrid pools, worked by hand from pool_configurator.py and
kv_cache_configurator.py. The same budgets go through SGLang's own configurator in
tests/shadow_env/test_hybrid_sglang.py."""

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import geometry_from_config, load_model_config
from kvprobe.theory.sglang.pools import SglangOptions, mamba_slots_per_request, sglang_layout, sglang_pools

GIB = 2**30


def model(name):
    cfg, _ = load_model_config(name)
    return cfg, geometry_from_config(cfg, name)


def test_layouts_follow_sglangs_own_rules():
    cfg, g = model("openai/gpt-oss-20b")
    lay = sglang_layout(cfg, g)
    assert (lay.pool, lay.swa_layer_ids[:2], lay.full_layer_ids[:2], lay.sliding_window_size) == \
        ("hybrid_swa", (0, 2), (1, 3), 127)  # window - 1 (models/gpt_oss.py L131-132)
    cfg, g = model("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    lay = sglang_layout(cfg, g)
    assert (len(lay.swa_layer_ids), lay.full_layer_ids[:2], lay.sliding_window_size) == (36, (3, 7), 8192)
    for name, why in (("google/gemma-3-27b-it", "Gemma 2/3"), ("mistralai/Mistral-7B-v0.1", "not a hybrid-SWA")):
        cfg, g = model(name)
        lay = sglang_layout(cfg, g)
        assert lay.pool == "full" and len(lay.full_layer_ids) == g.num_layers and why in lay.note
    cfg, g = model("Qwen/Qwen3-Next-80B-A3B-Instruct")
    lay = sglang_layout(cfg, g)
    assert (lay.pool, len(lay.mamba_layer_ids), lay.full_layer_ids[:2]) == ("mamba", 36, (3, 7))
    assert (lay.conv_shape, lay.temporal_shape, lay.conv_dtype, lay.ssm_dtype) == \
        ((8192, 3), (32, 128, 128), "bfloat16", "float32")
    assert lay.mamba_cache_per_req == 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4) == 77_266_944
    assert sglang_layout(cfg, g, SglangOptions(tp=2)).mamba_cache_per_req == 77_266_944 // 2


def test_gpt_oss_swa_split_by_hand():
    cfg, g = model("openai/gpt-oss-20b")
    p = sglang_pools(cfg, g, context_len=131072, rest_bytes=40 * GIB)
    # a token costs 12 x 2048 B in the full pool and 0.8 x 12 x 2048 B in the window pool
    assert p.max_total_num_tokens == int(40 * GIB // (24576 + 0.8 * 24576)) == 970903
    assert p.swa_tokens == int(970903 * 0.8) == 776722
    assert p.max_running_requests == int(970903 / 131072 * 512) == 3792
    capped = sglang_pools(cfg, g, context_len=131072, rest_bytes=40 * GIB, max_total_tokens=100000)
    assert (capped.max_total_num_tokens, capped.swa_tokens) == (100000, 80000)
    above = sglang_pools(cfg, g, context_len=131072, rest_bytes=40 * GIB, max_total_tokens=10**7)
    assert above.max_total_num_tokens == 970903  # a cap above the profiled pool changes nothing
    with pytest.raises(ConfigError, match=r"SWA pool \(120 tokens\) cannot hold even one request"):
        sglang_pools(cfg, g, context_len=131072, max_total_tokens=150)


def test_without_the_radix_cache_the_window_pool_is_sized_from_the_request_cap():
    cfg, g = model("openai/gpt-oss-20b")
    o = SglangOptions(disable_radix_cache=True, max_running_requests=64, chunked_prefill_size=8192)
    p = sglang_pools(cfg, g, context_len=131072, rest_bytes=40 * GIB, opts=o)
    # per request: window 127 + eviction interval 128 + page + one decode page; two chunks in flight
    assert p.swa_tokens == (127 + 128 + 1 + 1) * 64 + 2 * 8192 + 1 == 32833
    assert p.max_total_num_tokens == (40 * GIB - 32833 * 24576) // 24576


def test_qwen3_next_state_pool_then_full_pool_by_hand():
    cfg, g = model("Qwen/Qwen3-Next-80B-A3B-Instruct")
    per = 77_266_944
    p = sglang_pools(cfg, g, context_len=262144, rest_bytes=40 * GIB)
    slots = int((40 * 0.9 / 1.9 * GIB - per) // per)
    assert p.mamba_slots == slots == 262
    assert p.kv_bytes == int((40 - (slots + 1) * per / GIB) * GIB)
    assert p.max_total_num_tokens == p.kv_bytes // (12 * 2 * 512 * 2)
    assert p.max_running_requests == 262 // 5  # 3 + 2 tracking slots (extra_buffer, overlap)
    assert mamba_slots_per_request(SglangOptions(mamba_radix_cache_strategy="no_buffer")) == 3
    fixed = sglang_pools(cfg, g, context_len=262144, max_total_tokens=50000,
                         opts=SglangOptions(max_mamba_cache_size=100))
    assert (fixed.mamba_slots, fixed.max_total_num_tokens, fixed.max_running_requests) == (100, 50000, 20)
    with pytest.raises(ConfigError, match="max-mamba-cache-size") as err:
        sglang_pools(cfg, g, context_len=262144, max_total_tokens=50000)
    assert err.value.key == "max_mamba_cache_size"


def test_full_pools_for_gemma_and_mistral():
    cfg, g = model("google/gemma-3-27b-it")
    assert sglang_pools(cfg, g, context_len=131072, rest_bytes=40 * GIB).max_total_num_tokens == \
        40 * GIB // (62 * 16 * 256 * 2) == 84562
    cfg, g = model("mistralai/Mistral-7B-v0.1")
    assert sglang_pools(cfg, g, context_len=32768, rest_bytes=10 * GIB).max_total_num_tokens == \
        10 * GIB // (32 * 8 * 256 * 2)
