"""Layer kinds from config.json: the hybrid presets, the rules transformers fills in, and refusals.

The expected kinds are the ones the engines' own config reading produces (the shadow_env tests run
vLLM's `get_config` on the same files and compare)."""

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import geometry_from_config, kv_bytes_per_token, load_model_config
from kvprobe.theory.model.layers import CHUNKED, FULL, LINEAR, SLIDING, layer_kinds


def kinds_of(model):
    cfg, _ = load_model_config(model)
    return geometry_from_config(cfg, model).layers


@pytest.mark.parametrize("model,counts,window,chunk", [
    ("openai/gpt-oss-20b", {FULL: 12, SLIDING: 12}, 128, None),
    ("openai/gpt-oss-120b", {FULL: 18, SLIDING: 18}, 128, None),
    ("google/gemma-3-27b-it", {FULL: 10, SLIDING: 52}, 1024, None),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", {FULL: 12, CHUNKED: 36}, None, 8192),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", {FULL: 12, LINEAR: 36}, None, None),
    ("mistralai/Mistral-7B-v0.1", {SLIDING: 32}, 4096, None),
    ("mistralai/Mistral-7B-v0.3", {FULL: 32}, None, None),
    ("Qwen/Qwen2.5-7B", {FULL: 28}, None, None),  # sliding_window 131072 but use_sliding_window false
])
def test_preset_layer_kinds(model, counts, window, chunk):
    lk = kinds_of(model)
    assert {k: lk.count(k) for k in (FULL, SLIDING, CHUNKED, LINEAR) if lk.count(k)} == counts
    assert (lk.sliding_window, lk.attention_chunk_size) == (window, chunk)
    assert lk.hybrid == (counts != {FULL: sum(counts.values())})


def test_patterns_put_the_global_layers_where_the_engines_do():
    assert kinds_of("openai/gpt-oss-20b").ids(SLIDING)[:3] == (0, 2, 4)  # even layers (gpt_oss.py L175)
    assert kinds_of("google/gemma-3-27b-it").ids(FULL) == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59)
    assert kinds_of("meta-llama/Llama-4-Scout-17B-16E-Instruct").ids(FULL)[:3] == (3, 7, 11)
    next_ = kinds_of("Qwen/Qwen3-Next-80B-A3B-Instruct")
    assert next_.ids(FULL)[:3] == (3, 7, 11)
    g = next_.linear
    assert (g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim, g.conv_kernel) == (16, 32, 128, 128, 4)
    assert g.conv_dim == 8192  # 128*16*2 + 128*32


def test_kv_bytes_count_only_layers_that_keep_kv_per_token():
    cfg, _ = load_model_config("Qwen/Qwen3-Next-80B-A3B-Instruct")
    kv = kv_bytes_per_token(geometry_from_config(cfg))
    assert (kv.layers_per_rank, kv.per_layer_main, kv.total) == (12, 2 * 2 * 256 * 2, 12 * 2048)
    cfg, _ = load_model_config("openai/gpt-oss-20b")
    assert kv_bytes_per_token(geometry_from_config(cfg)).total == 24 * 8 * 128 * 2


def test_defaults_the_config_classes_fill_in():
    base = {"model_type": "gemma3_text", "sliding_window": 512}
    assert layer_kinds({**base, "sliding_window_pattern": 2}, 4).kinds == (SLIDING, FULL, SLIDING, FULL)
    assert layer_kinds(base, 6).ids(FULL) == (5,)  # default pattern 6
    llama4 = {"model_type": "llama4_text", "no_rope_layers": [1, 0, 1, 0]}
    assert layer_kinds(llama4, 4).kinds == (CHUNKED, FULL, CHUNKED, FULL)
    assert layer_kinds({"model_type": "llama4_text"}, 4).attention_chunk_size == 8192  # class default
    assert layer_kinds({"model_type": "llama4_text", "attention_chunk_size": None}, 4).kinds == (FULL,) * 4
    mistral = layer_kinds({"model_type": "mistral"}, 2)  # MistralConfig default window 4096
    assert (mistral.kinds, mistral.sliding_window) == ((SLIDING, SLIDING), 4096)
    assert not layer_kinds({"model_type": "mistral", "sliding_window": 0}, 2).hybrid


@pytest.mark.parametrize("cfg,key,words", [
    ({"model_type": "llama", "layer_types": ["full_attention", "mamba"]}, "layer_types", "mamba"),
    ({"model_type": "llama", "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8},
     "layer_types", "non-full layers"),
    ({"model_type": "gpt_oss", "sliding_window": 128,
      "layer_types": ["full_attention", "sliding_attention"]}, "layer_types", "even layers"),
    ({"model_type": "mixtral", "sliding_window": 4096}, "sliding_window", "which layers"),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}, "use_sliding_window",
     "max_window_layers"),
    ({"model_type": "jamba", "layers_block_type": ["mamba", "attention"]}, "layers_block_type", "does not model"),
    ({"model_type": "cohere2", "sliding_window_pattern": 4, "sliding_window": 4096}, "sliding_window_pattern",
     "Gemma 3"),
    ({"model_type": "qwen3_5", "linear_num_value_heads": 32}, "linear_num_value_heads", "Gated DeltaNet"),
    ({"model_type": "phi3", "attention_chunk_size": 2048}, "attention_chunk_size", "Llama 4"),
    ({"model_type": "qwen3_next", "full_attention_interval": 4, "linear_num_key_heads": 16}, "linear_num_value_heads",
     "positive integer"),
    ({"model_type": "gemma3_text", "sliding_window": 512, "use_bidirectional_attention": True},
     "use_bidirectional_attention", "bidirectional"),
])
def test_unknown_layer_kinds_are_config_errors_naming_the_key(cfg, key, words):
    with pytest.raises(ConfigError, match=words) as err:
        layer_kinds(cfg, 2, source="x/config.json")
    assert err.value.key == key and str(err.value).startswith(f"x/config.json: {key}:")
    assert "\n" not in str(err.value)


def test_the_preset_error_reaches_geometry():
    cfg, _ = load_model_config("openai/gpt-oss-20b")
    bad = {**cfg, "layer_types": ["mystery_attention"] * 24}
    with pytest.raises(ConfigError, match="mystery_attention"):
        geometry_from_config(bad, source="gpt.json")
