"""gpt-oss's MXFP4 experts in the weight budget (kvprobe/theory/model/mxfp4.py, geometry.weight_bytes).

Checked against figures no one here wrote:
* the checkpoints' tensor bytes (their safetensors index `total_size`): gpt-oss-20b 13,761,264,768 B
  (cited in model/presets.py); gpt-oss-120b 65,248,815,744 B, asserted as the tensor bytes of the 15
  weight files (65,248,893,184 B on disk with their headers) by a public deployment test in the code
  index, and the 60.8 GiB the gpt-oss model card lists (= 65,248,815,744 / 2^30, as quoted by
  fitmygpu.com/models/gpt-oss-120b);
* the parameter counts of the de-quantised models in keras-team/keras-hub
  `keras_hub/src/models/gpt_oss/gpt_oss_presets.py`: 20,914,757,184 and 116,829,156,672.
The engines' padding is the one their create_weights allocates (mxfp4.py's doc cites file:line);
every byte between the checkpoint and an engine's figure is accounted for below.
"""

from __future__ import annotations

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import geometry_from_config, load_model_config, weight_bytes
from kvprobe.theory.model.mxfp4 import engine_expert_dims, expert_tensor_bytes

# preset -> (index total_size, keras-hub params, layers, experts)
PUBLISHED = {
    "openai/gpt-oss-20b": (13_761_264_768, 20_914_757_184, 24, 32),
    "openai/gpt-oss-120b": (65_248_815_744, 116_829_156_672, 36, 128),
}
H = INTER = 2880  # hidden_size, intermediate_size (both presets)
HEADS = 64


def geom(model):
    cfg, src = load_model_config(model)
    return geometry_from_config(cfg, model, source=src)


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_checkpoint_bytes_and_params_are_the_published_ones(model):
    total_size, params, _, _ = PUBLISHED[model]
    g = geom(model)
    assert g.quantized_mxfp4
    assert g.weight_bytes_total == total_size
    assert weight_bytes(g) == total_size  # no engine: the checkpoint, one rank
    assert g.param_count == params


def test_one_expert_in_the_checkpoint_layout():
    """w13 [2I, H]: 5,760 rows of 1,440 packed bytes + 90 E8M0 scales + a 2-byte bf16 bias = 1,532 B;
    w2 [H, I]: 2,880 rows of the same 1,532 B."""
    assert expert_tensor_bytes("w13", 1, H, INTER) == 5760 * 1532 == 8_824_320
    assert expert_tensor_bytes("w2", 1, H, INTER) == 2880 * 1532 == 4_412_160
    assert expert_tensor_bytes("w2", 1, H, INTER, bias=False) == 2880 * 1530


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_on_hopper_both_engines_hold_the_checkpoint_bytes(model, engine):
    """sm90: vLLM's TRITON and SGLang's triton_kernel round I to 64 — 2880 already is — and leave H;
    sinks stay bf16. Not one byte differs from the checkpoint."""
    assert engine_expert_dims(engine, "sm90", H, INTER, 1) == (2880, 2880)
    assert weight_bytes(geom(model), engine=engine, gpu_arch="sm90") == PUBLISHED[model][0]


# Blackwell pads H 2880 -> 3072 and I 2880 -> 2944: one expert's w13 grows from 5,760 x 1,532 B to
# 5,888 x (1,536 + 96 + 2) = 9,620,992 B, its w2 from 2,880 x 1,532 to 3,072 x (1,472 + 92 + 2) =
# 4,810,752 B: +796,672 + 398,592 = +1,195,264 B per expert per layer.
PAD_PER_EXPERT = (5888 * 1634 - 5760 * 1532) + (3072 * 1566 - 2880 * 1532)


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_on_blackwell_the_padding_is_every_extra_byte(model):
    total_size, _, layers, experts = PUBLISHED[model]
    assert PAD_PER_EXPERT == 1_195_264
    g = geom(model)
    assert engine_expert_dims("vllm", "sm100", H, INTER, 1) == (3072, 2944)
    assert engine_expert_dims("sglang", "sm100", H, INTER, 1) == (3072, 2944)
    vllm = weight_bytes(g, engine="vllm", gpu_arch="sm100")
    assert vllm == total_size + layers * experts * PAD_PER_EXPERT
    # SGLang's sm100 attention backend, trtllm_mha, takes float32 sinks: +2 B per head per layer
    assert weight_bytes(g, engine="sglang", gpu_arch="sm100") == vllm + layers * HEADS * 2


def test_gpt_oss_20b_worked_figures():
    g = geom("openai/gpt-oss-20b")
    assert weight_bytes(g, engine="vllm", gpu_arch="sm100") == 14_679_227_520  # 13.67 GiB
    assert weight_bytes(g, engine="sglang", gpu_arch="sm100") == 14_679_230_592


def test_on_ada_vllm_pads_for_marlin_like_blackwell():
    """sm89 (L4, L40S, RTX 4090): vLLM 0.29.0 has no native MXFP4 MoE kernel there and picks MARLIN
    (the corpus's L4 log: `Using 'MARLIN' Mxfp4 MoE backend.`), which rounds I to 128 and H to 256
    (oracle/mxfp4.py L734-739): Blackwell's 3072 / 2944, so every extra byte is the same padding, and
    vLLM's sinks stay bf16 on both. SGLang's layout there is not read: refused, naming the key."""
    g = geom("openai/gpt-oss-20b")
    assert engine_expert_dims("vllm", "sm89", H, INTER, 1) == (3072, 2944)
    assert weight_bytes(g, engine="vllm", gpu_arch="sm89") == 13_761_264_768 + 24 * 32 * PAD_PER_EXPERT
    assert weight_bytes(g, engine="vllm", gpu_arch="sm89") == weight_bytes(g, engine="vllm", gpu_arch="sm100")
    with pytest.raises(ConfigError, match="sglang's MXFP4 expert layout on sm89 is not read") as err:
        weight_bytes(g, engine="sglang", gpu_arch="sm89")
    assert err.value.key == "gpu_arch"


def test_tensor_parallel_pads_the_intermediate_per_rank():
    """TP 4 on Hopper: I per rank 2880 / 4 = 720 -> 768 (a multiple of 64), H whole. One rank holds
    all 32 experts' [2 x 768, 2880] and [2880, 768] slices; the bf16 rest splits by TP as before."""
    g = geom("openai/gpt-oss-20b")
    assert engine_expert_dims("vllm", "sm90", H, INTER, 4) == (2880, 768)
    per_rank_experts = 24 * (expert_tensor_bytes("w13", 32, 2880, 768) + expert_tensor_bytes("w2", 32, 2880, 768))
    assert per_rank_experts == 24 * 32 * (1536 * (1440 + 90 + 2) + 2880 * (384 + 24 + 2))
    # without an engine the experts split like any TP part: ceil(bytes / 4) per layer
    split_checkpoint = sum(-(-p.nbytes // 4) * len(p.layers) for p in g.weight_parts
                           if p.special.startswith("mxfp4_"))
    assert weight_bytes(g, tp=4, engine="vllm") == weight_bytes(g, tp=4) - split_checkpoint + per_rank_experts
    assert weight_bytes(g, tp=4, engine="vllm") == 3_616_517_760


def test_an_unknown_gpu_arch_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="sm90, sm100") as err:
        weight_bytes(geom("openai/gpt-oss-20b"), engine="vllm", gpu_arch="sm80")
    assert err.value.key == "gpu_arch"


def test_a_non_mxfp4_model_is_unchanged_by_engine_or_arch():
    cfg, src = load_model_config("meta-llama/Llama-3.1-8B")
    g = geometry_from_config(cfg, "meta-llama/Llama-3.1-8B", source=src)
    assert not g.quantized_mxfp4
    assert weight_bytes(g, engine="sglang", gpu_arch="sm100") == weight_bytes(g) == 8_030_261_248 * 2


def test_mxfp4_on_another_model_is_refused_naming_the_key():
    cfg, _ = load_model_config("Qwen/Qwen3-8B")
    cfg = {**cfg, "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ConfigError, match="gpt-oss only") as err:
        geometry_from_config(cfg, "qwen3-mxfp4.json")
    assert err.value.key == "quantization_config.quant_method" and "qwen3" in str(err.value)
