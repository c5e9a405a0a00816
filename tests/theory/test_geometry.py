"""Geometry: parameter counts against published checkpoint sizes, KV bytes per engine layout."""

import json
from pathlib import Path

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import (
    PRESETS,
    geometry_from_config,
    kv_bytes_per_token,
    list_presets,
    load_model_config,
    pp_stages,
    weight_bytes,
)

ROOT = Path(__file__).resolve().parents[2]


def geom(model, **kw):
    cfg, _ = load_model_config(model)
    return geometry_from_config(cfg, model, **kw)


# Published totals: Llama-3.1-8B model card; the others are the checkpoints' index total_size / 2
# (bf16), DeepSeek-V3's 671B main model (the 685B on the hub includes the 14B MTP module).
@pytest.mark.parametrize("model,params", [
    ("meta-llama/Llama-3.1-8B", 8_030_261_248),
    ("meta-llama/Llama-3.1-70B", 70_553_706_496),
    ("Qwen/Qwen2.5-7B", 7_615_616_512),
    ("Qwen/Qwen3-8B", 8_190_735_360),
    ("mistralai/Mistral-7B-v0.3", 7_248_023_552),
])
def test_dense_param_counts_are_exact(model, params):
    assert geom(model).param_count == params


def test_deepseek_v3_is_671b_mla_moe_fp8():
    g = geom("deepseek-ai/DeepSeek-V3")
    assert round(g.param_count / 1e9) == 671
    assert (g.attention, g.num_layers, g.moe, g.quantized_fp8, g.weight_dtype_bytes) == ("mla", 61, True, True, 1)
    # fp8 weights: about one byte per parameter (embeddings/lm_head stay bf16, plus block scales)
    assert 1.0 < g.weight_bytes_total / g.param_count < 1.01


def test_tied_embeddings_drop_lm_head():
    cfg, _ = load_model_config("meta-llama/Llama-3.1-8B")
    untied = geometry_from_config(cfg).param_count
    tied = geometry_from_config({**cfg, "tie_word_embeddings": True}).param_count
    assert untied - tied == 128256 * 4096


def test_gemma_ties_lm_head_when_its_config_does_not_say():
    """google/gemma-7b's config.json has no tie_word_embeddings; GemmaConfig defaults it to True and vLLM's
    gemma.py asserts it. keras-hub's gemma_7b_en preset states 8,537,680,896 parameters."""
    cfg = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_size": 3072,
           "intermediate_size": 24576, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
           "num_hidden_layers": 28, "vocab_size": 256000, "max_position_embeddings": 8192,
           "torch_dtype": "bfloat16"}
    assert geometry_from_config(cfg).param_count == 8_537_680_896
    assert geometry_from_config({**cfg, "tie_word_embeddings": False}).param_count == 8_537_680_896 + 256000 * 3072


def test_gemma_head_dim_defaults_to_256_as_transformers_does():
    """Gemma3TextConfig's head_dim is 256 unless config.json says (transformers 5.20 configuration_gemma3.py L80):
    a Gemma-3 12B geometry (hidden 3840, 16 heads of 8 KV) without it has 256-wide heads, not 3840 / 16 = 240."""
    cfg = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 3840,
           "intermediate_size": 15360, "num_attention_heads": 16, "num_key_value_heads": 8, "num_hidden_layers": 48,
           "sliding_window": 1024, "torch_dtype": "bfloat16"}
    g = geometry_from_config(cfg)
    assert g.head_dim == 256 and geometry_from_config({**cfg, "head_dim": 240}).head_dim == 240


def test_qwen2_moe_counts_its_shared_expert():
    """Qwen/Qwen1.5-MoE-A2.7B's geometry (60 experts of 1,408 and one shared expert of 5,632 per layer); keras-hub's
    qwen1.5_moe_2.7b_en preset states 14,315,784,192 parameters."""
    cfg = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
           "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
           "num_experts": 60, "num_experts_per_tok": 4, "num_attention_heads": 16, "num_key_value_heads": 16,
           "num_hidden_layers": 24, "vocab_size": 151936, "max_position_embeddings": 8192,
           "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    assert geometry_from_config(cfg).param_count == 14_315_784_192


def test_qwen2_attention_bias_is_counted():
    cfg, _ = load_model_config("Qwen/Qwen2.5-7B")
    as_llama = geometry_from_config({**cfg, "model_type": "llama"}).param_count
    assert geometry_from_config(cfg).param_count - as_llama == 28 * (3584 + 512 + 512)


def test_phi_mlp_is_two_matrices_with_biases():
    """phi-2 (vLLM phi.py: fc1/fc2 and qkv/dense with biases, a LayerNorm and a biased lm_head) against its
    checkpoint's index: total_size 5,559,367,680 bytes in fp16 (microsoft/phi-2 model.safetensors.index.json,
    as a public tutorial quotes it with its weight_map), 2,779,683,840 parameters. Counted as a gated Llama MLP
    it was 30% high, and the corpus's phi-2 pool 2.2% low."""
    cfg = json.loads((ROOT / "tests/data/gpu_logs/vllm-configs/phi-2.json").read_text())
    g = geometry_from_config(cfg, "microsoft/phi-2")
    assert g.param_count == 2_779_683_840 and weight_bytes(g) == 5_559_367_680
    llama = geometry_from_config({**cfg, "model_type": "llama"}).param_count  # a gate of 32 x 10240 x 2560 more
    assert llama - g.param_count == 32 * 10240 * 2560 - 32 * (3 * 2560 + 2560 + 10240 + 2560) - 2560 - 51200


@pytest.mark.parametrize("model,per_token", [
    ("meta-llama/Llama-3.1-8B", 131072),   # 2 x 8 heads x 128 x 32 layers x 2 B
    ("Qwen/Qwen2.5-7B", 57344),
    ("meta-llama/Llama-3.1-70B", 327680),
    ("deepseek-ai/DeepSeek-V3", 70272),    # (512 + 64) x 61 x 2, no factor 2 for MLA
])
def test_kv_bytes_per_token_bf16(model, per_token):
    assert kv_bytes_per_token(geom(model)).total == per_token


def test_gqa_tp_divides_kv_heads_but_keeps_one():
    g = geom("meta-llama/Llama-3.1-8B")
    assert kv_bytes_per_token(g, tp=2).total == 131072 // 2
    assert kv_bytes_per_token(g, tp=8).kv_heads_per_rank == 1
    assert kv_bytes_per_token(g, tp=16).kv_heads_per_rank == 1  # replicated beyond 8 ranks
    assert kv_bytes_per_token(g, kv_cache_dtype="fp8").total == 65536
    assert kv_bytes_per_token(g, kv_cache_dtype="fp8_e5m2").total == 65536


def test_mla_latent_is_not_split_by_tp():
    g = geom("deepseek-ai/DeepSeek-V3")
    assert kv_bytes_per_token(g, tp=8).total == kv_bytes_per_token(g).total == 70272
    assert kv_bytes_per_token(g, kv_cache_dtype="fp8_ds_mla").per_layer_main == 656


def test_glm53_seed002_bytes():
    g = geom("zai-org/GLM-5.3")
    assert (g.num_layers, g.indexer_layers, g.indexer_head_dim, g.kv_lora_rank) == (78, 21, 128, 512)
    kv = kv_bytes_per_token(g, kv_cache_dtype="fp8_ds_mla")
    assert (kv.per_layer_main, kv.main) == (656, 51_168)
    assert (kv.per_layer_indexer, kv.indexer) == (132, 2_772)
    assert kv.total == 53_940
    assert kv.total * 64 == 3_452_160  # one 64-token block, main + indexer pages


def test_indexer_without_types_covers_every_layer(tmp_path):
    cfg, _ = load_model_config("zai-org/GLM-5.3")
    del cfg["indexer_types"]
    kv = kv_bytes_per_token(geometry_from_config(cfg), kv_cache_dtype="fp8_ds_mla")
    assert kv.indexer == 78 * 132


def test_fp8_ds_mla_refused_for_standard_attention():
    with pytest.raises(ConfigError, match="MLA"):
        kv_bytes_per_token(geom("Qwen/Qwen3-8B"), kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        kv_bytes_per_token(geom("Qwen/Qwen3-8B"), kv_cache_dtype="int3")


def test_pp_ceil_split_and_weights_per_rank():
    assert [len(s) for s in pp_stages(61, 4)] == [16, 16, 16, 13]
    g = geom("meta-llama/Llama-3.1-8B")
    assert kv_bytes_per_token(g, pp=3).layers_per_rank == 11
    whole = weight_bytes(g)
    assert whole == g.param_count * 2
    assert weight_bytes(g, tp=2) < whole * 0.51
    assert weight_bytes(g, pp=2) < whole * 0.55
    with pytest.raises(ConfigError):
        pp_stages(32, 33)


def test_dtype_override_changes_weights_and_auto_kv():
    g = geom("meta-llama/Llama-3.1-8B", dtype="float32")
    assert g.dtype_bytes == 4 and kv_bytes_per_token(g).total == 262144


def test_presets_all_load_and_list():
    assert list_presets() == sorted(PRESETS)
    for model in list_presets():
        cfg, source = load_model_config(model)
        assert model in source and geometry_from_config(cfg).num_layers > 0


def test_load_from_path_dir_and_base_dir(tmp_path):
    cfg, _ = load_model_config("Qwen/Qwen3-8B")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    by_dir, src = load_model_config(str(tmp_path / "m"))
    assert by_dir == cfg and src.endswith("config.json")
    rel, _ = load_model_config("m/config.json", base_dir=str(tmp_path))
    assert rel == cfg


def test_bad_inputs_are_one_line_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown model 'acme/Nope-1B'"):
        load_model_config("acme/Nope-1B")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON") as err:
        load_model_config(str(bad))
    assert str(bad) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no model config"):
        load_model_config(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        geometry_from_config({"hidden_size": 8, "num_attention_heads": 1}, source="x.json")
    with pytest.raises(ConfigError, match="hidden_size"):
        geometry_from_config({"num_hidden_layers": 2, "hidden_size": "big", "num_attention_heads": 1})
