"""vLLM 0.33.0's hybrid KV plan, worked by hand from the source (kv_cache_interface.py,
kv_cache_planning.py, kv_cache_utils.py). The same plans are run through vLLM's own planner in
tests/shadow_env/test_hybrid_vllm.py."""

import dataclasses
import json

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import geometry_from_config, load_model_config
from kvprobe.theory.vllm.hybrid.kv_cache_planning import vllm_kv_plan
from kvprobe.theory.vllm.hybrid.kv_cache_spec import (
    CHUNKED_SPEC,
    FULL_SPEC,
    MAMBA_SPEC,
    SLIDING_SPEC,
    VllmOptions,
    hybrid_block_size,
    vllm_layer_specs,
)

GIB = 2**30


def geom(model):
    cfg, _ = load_model_config(model)
    return geometry_from_config(cfg, model)


def test_gpt_oss_specs_alternate_window_and_full():
    specs = vllm_layer_specs(geom("openai/gpt-oss-20b"))
    assert [s.spec for s in specs[:2]] == [SLIDING_SPEC, FULL_SPEC] and len(specs) == 24
    s = specs[0]
    assert (s.block_size, s.num_kv_heads, s.head_size, s.head_size_v, s.dtype, s.sliding_window) == \
        (16, 8, 64, 64, "bfloat16", 128)
    assert s.page_size_bytes == 16 * 8 * (64 + 64) * 2 == 32768


def test_gpt_oss_20b_plan_by_hand():
    # two groups of 12 layers: one block = 12 x 32768 B; 10 GiB -> 27306 blocks (null block included)
    # a request of 8192 tokens with 2 x 8192 tokens in flight (async scheduling): full 512 blocks,
    # window cdiv(min(127 + 16384, 8192), 16) + 1 = 513 -> 27306 / 1025 = 26.64x, 218234 tokens
    p = vllm_kv_plan(geom("openai/gpt-oss-20b"), max_model_len=8192, available_bytes=10 * GIB,
                     opts=VllmOptions(max_num_batched_tokens=8192))
    assert [(g.spec, len(g.layers), g.blocks_per_request) for g in p.groups] == \
        [(SLIDING_SPEC, 12, 513), (FULL_SPEC, 12, 512)]
    assert (p.bytes_per_block, p.num_blocks, p.blocks_per_request) == (393216, 27306, 1025)
    assert round(p.max_concurrency, 2) == 26.64 and p.kv_tokens == 218234
    # the window's bound is what in-flight tokens leave: sync scheduling, 2048 per step, long context
    long = vllm_kv_plan(geom("openai/gpt-oss-20b"), max_model_len=131072, available_bytes=10 * GIB,
                        opts=VllmOptions(async_scheduling=False))
    assert [g.blocks_per_request for g in long.groups] == [-(-(127 + 2048) // 16) + 1, 8192]


def test_the_plan_gives_the_capacity_line_vllm_logs():
    """`GPU KV cache size: N tokens, Maximum concurrency for L tokens per request: X.XXx`
    (kv_cache_utils.py L1136-1154): the plan's kv_tokens and max_concurrency; the specs travel to the
    shadow worker as JSON."""
    p = vllm_kv_plan(geom("openai/gpt-oss-20b"), max_model_len=8192, available_bytes=10 * GIB,
                     opts=VllmOptions(max_num_batched_tokens=8192))
    line = (f"GPU KV cache size: {p.kv_tokens:,} tokens, Maximum concurrency for {p.max_model_len:,} "
            f"tokens per request: {p.max_concurrency:.2f}x")
    assert line == "GPU KV cache size: 218,234 tokens, Maximum concurrency for 8,192 tokens per request: 26.64x"
    assert json.loads(json.dumps(dataclasses.asdict(p.specs[0])))["spec"] == SLIDING_SPEC


def test_without_the_hybrid_manager_windows_plan_as_full_attention():
    p = vllm_kv_plan(geom("openai/gpt-oss-20b"), max_model_len=8192, available_bytes=10 * GIB,
                     opts=VllmOptions(hybrid_kv_cache_manager=False))
    assert [(g.spec, len(g.layers)) for g in p.groups] == [(FULL_SPEC, 24)]
    assert (p.bytes_per_block, p.num_blocks, p.blocks_per_request) == (786432, 13653, 512)
    assert p.hma_reason == "--disable-hybrid-kv-cache-manager"


def test_llama4_chunked_layers_get_their_own_groups_unless_the_env_var_says_0():
    g = geom("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    p = vllm_kv_plan(g, max_model_len=65536, available_bytes=40 * GIB)  # the env var defaults to 1
    assert p.hybrid_kv_cache_manager
    assert [(x.spec, len(x.layers)) for x in p.groups] == [(CHUNKED_SPEC, 12)] * 3 + [(FULL_SPEC, 12)]
    # a chunk layer holds the chunk plus the tokens in flight: cdiv(8192 + 2 x 2048, 16)
    assert p.groups[0].blocks_per_request == 768
    off = VllmOptions(allow_chunked_local_attn_with_hybrid_kv_cache=False)
    q = vllm_kv_plan(g, max_model_len=65536, available_bytes=40 * GIB, opts=off)
    assert not q.hybrid_kv_cache_manager and "=0" in q.hma_reason
    assert [(x.spec, len(x.layers)) for x in q.groups] == [(FULL_SPEC, 48)]
    assert q.bytes_per_block == 48 * 16 * 8 * 256 * 2
    with pytest.raises(ConfigError, match="explicitly enabled"):
        vllm_kv_plan(g, max_model_len=65536, available_bytes=40 * GIB,
                     opts=VllmOptions(hybrid_kv_cache_manager=True,
                                      allow_chunked_local_attn_with_hybrid_kv_cache=False))


def test_gemma3_window_groups_are_padded_to_the_full_group_size():
    p = vllm_kv_plan(geom("google/gemma-3-27b-it"), max_model_len=131072, available_bytes=40 * GIB)
    assert [(x.spec, len(x.layers), x.padding_layers) for x in p.groups] == \
        [(SLIDING_SPEC, 9, 1)] * 4 + [(SLIDING_SPEC, 8, 2)] * 2 + [(FULL_SPEC, 10, 0)]
    assert p.bytes_per_block == 10 * 16 * 16 * 256 * 2  # the widest group sets the block


def test_qwen3_next_block_grows_to_hold_a_gdn_state():
    g = geom("Qwen/Qwen3-Next-80B-A3B-Instruct")
    # state: conv 3 x 8192 bf16 = 49152 B + recurrent 32 x 128 x 128 bf16 = 1048576 B; one token of
    # a full layer: 2 heads x 512 x 2 B = 2048 B. FlashInfer (Hopper) aligns to 64: 64 x cdiv(1097728,
    # 64 x 2048) = 576; Triton to 16: 16 x 34 = 544.
    assert hybrid_block_size(g, VllmOptions()) == (576, 576 * 2048)
    assert hybrid_block_size(g, VllmOptions(gdn_prefill_backend="triton")) == (544, 544 * 2048)
    specs = vllm_layer_specs(g)
    state = next(s for s in specs if s.spec == MAMBA_SPEC)
    assert state.shapes == ((3, 8192), (32, 128, 128)) and state.dtypes == ("bfloat16", "bfloat16")
    # one checkpoint block on the prefix-cache grid, the Mamba block (mamba/abstract.py L116-129)
    assert (state.page_size_bytes, state.num_prefill_checkpoint_blocks, state.prefill_checkpoint_alignment) == \
        (576 * 2048, 1, 576)
    p = vllm_kv_plan(g, max_model_len=262144, available_bytes=40 * GIB,
                     opts=VllmOptions(max_num_batched_tokens=8192))
    assert [(x.spec, len(x.layers), x.blocks_per_request) for x in p.groups] == \
        [(MAMBA_SPEC, 12, 3)] * 3 + [(FULL_SPEC, 12, -(-262144 // 576))]
    assert (p.block_size, p.bytes_per_block, p.num_blocks) == (576, 12 * 576 * 2048, 3034)
    # without prefix caching the state is one block per request, and no larger than it must be
    off = vllm_kv_plan(g, max_model_len=262144, available_bytes=40 * GIB,
                       opts=VllmOptions(enable_prefix_caching=False))
    assert off.block_size == 544 and off.groups[0].blocks_per_request == 1
    assert vllm_layer_specs(g, VllmOptions(enable_prefix_caching=False), max_model_len=4096)[0].block_size == 4096


def test_mistral_v01_windows_every_layer_in_one_group():
    p = vllm_kv_plan(geom("mistralai/Mistral-7B-v0.1"), max_model_len=32768, available_bytes=10 * GIB)
    assert [(x.spec, len(x.layers)) for x in p.groups] == [(SLIDING_SPEC, 32)]
    assert p.blocks_per_request == -(-(4095 + 4096) // 16) + 1


def test_override_auto_fit_and_the_too_small_error():
    g = geom("openai/gpt-oss-20b")
    p = vllm_kv_plan(g, max_model_len=8192, num_gpu_blocks_override=2000)  # 2 x 2048 in flight
    assert (p.num_blocks, p.usable_blocks) == (2000, 1999) and p.max_concurrency == 2000 / (512 + 265)
    with pytest.raises(ConfigError, match=r"max seq len \(131072\).*estimated maximum model length is") as err:
        vllm_kv_plan(g, max_model_len=131072, num_gpu_blocks_override=5000)
    assert "\n" not in str(err.value)
    fit = vllm_kv_plan(g, max_model_len=131072, num_gpu_blocks_override=5000, auto_fit=True)
    assert fit.max_model_len < 131072 and fit.blocks_per_request <= fit.usable_blocks
    with pytest.raises(ConfigError, match="max seq len"):  # the longest that fits: one token more does not
        vllm_kv_plan(g, max_model_len=fit.max_model_len + 1, num_gpu_blocks_override=5000)


def test_refusals():
    with pytest.raises(ConfigError, match="pipeline"):
        vllm_layer_specs(geom("openai/gpt-oss-20b"), VllmOptions(pp=2))
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        vllm_layer_specs(geom("openai/gpt-oss-20b"), VllmOptions(cache_dtype="fp8_ds_mla"))
    with pytest.raises(ConfigError, match="max_model_len"):
        vllm_layer_specs(geom("Qwen/Qwen3-Next-80B-A3B-Instruct"), VllmOptions(enable_prefix_caching=False))
