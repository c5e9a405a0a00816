"""Quantised checkpoints as vLLM allocates them (kvprobe/theory/model/quant.py), method by method:
the layout of one linear layer against vLLM 0.33.0's create_weights, and the whole model against the
weights memory a real start-up log reports (tests/data/gpu_logs/) where the corpus has one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import geometry_from_config, weight_bytes
from kvprobe.theory.model.quant import LinearQuant, linear_quant
from kvprobe.theory.model.sizes import GIB

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "kvprobe" / "theory" / "model" / "configs"
LOGS = ROOT / "tests" / "data" / "gpu_logs"


def config(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def logged_weights(case: str) -> float:
    return yaml.safe_load((LOGS / f"{case}.yaml").read_text())["logged"]["weights_gib"]


def weights_per_rank(cfg: dict, tp: int, dtype: str | None = None) -> float:
    return weight_bytes(geometry_from_config(cfg, dtype=dtype), tp=tp, engine="vllm") / GIB


# -- one layer, as create_weights registers it (bytes of each parameter) --------------------------------

def test_gptq_layer_is_qweight_scales_and_qzeros():
    """auto_gptq.py: qweight int32 [in/8, out], scales fp16 [in/128, out], qzeros int32 [in/128, out/8]."""
    q = linear_quant({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                              "desc_act": False, "sym": True}}, 2, "c.json")
    out_f, in_f = 14336, 4096
    assert q.nbytes(out_f, in_f) == in_f // 8 * out_f * 4 + in_f // 128 * out_f * 2 + in_f // 128 * out_f // 8 * 4


def test_gptq_marlin_repacks_in_place():
    """The Marlin kernel repacks qweight and permutes scales in place: the bytes of plain GPTQ."""
    cfg = {"quant_method": "gptq_marlin", "bits": 4, "group_size": 128}
    marlin = linear_quant({"quantization_config": cfg}, 2, "c.json")
    plain = linear_quant({"quantization_config": {**cfg, "quant_method": "gptq"}}, 2, "c.json")
    assert marlin.nbytes(4096, 4096) == plain.nbytes(4096, 4096)


def test_awq_layer_is_qweight_qzeros_and_scales():
    """auto_awq.py: qweight int32 [in, out/8], qzeros int32 [in/128, out/8], scales [in/128, out]."""
    q = linear_quant({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                              "zero_point": True, "version": "gemm"}}, 2, "c.json")
    out_f, in_f = 18944, 3584
    assert q.nbytes(out_f, in_f) == in_f * out_f // 8 * 4 + in_f // 128 * out_f // 8 * 4 + in_f // 128 * out_f * 2


def test_channelwise_group_is_one_scale_per_output_row():
    q = LinearQuant("gptq", 4, -1, 2, zero_points=True)
    assert q.nbytes(256, 1024) == 256 * 1024 // 2 + 256 * 2 + 256 // 8 * 4


def test_compressed_tensors_schemes():
    def ct(weights, fmt):
        return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
                                        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}}
    fp8 = linear_quant(ct({"num_bits": 8, "type": "float", "strategy": "channel"}, "float-quantized"), 2, "c")
    assert fp8.fp8 and fp8.nbytes(1024, 4096) == 1024 * 4096 + 1024 * 4  # fp8 weight + fp32 scale per row
    static = linear_quant(ct({"num_bits": 8, "type": "float", "strategy": "tensor"}, "float-quantized"), 2, "c")
    assert static.nbytes(1024, 4096) == 1024 * 4096
    int8 = linear_quant(ct({"num_bits": 8, "type": "int", "strategy": "channel"}, "int-quantized"), 2, "c")
    assert int8.nbytes(1024, 4096) == 1024 * 4096 + 1024 * 4
    w4 = linear_quant(ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                          "symmetric": True}, "pack-quantized"), 2, "c")
    assert w4.nbytes(1024, 4096) == 1024 * 4096 // 8 * 4 + 1024 * 32 * 2  # weight_packed + weight_scale
    asym = linear_quant(ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                            "symmetric": False}, "pack-quantized"), 2, "c")
    assert asym.nbytes(1024, 4096) - w4.nbytes(1024, 4096) == 1024 // 8 * 32 * 4  # weight_zero_point int32


def test_fp8_block_scales():
    q = linear_quant({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, 2, "c")
    assert q.nbytes(7168, 2048) == 7168 * 2048 + 56 * 16 * 4


# -- whole checkpoints against the weights a real log reports ----------------------------------------

@pytest.mark.parametrize(("preset", "case", "tp", "dtype", "within"), [
    # compressed-tensors FP8 dynamic (channel scales), 4 x H100, vLLM 0.19.0: 16.96 GiB per rank
    ("llama-3.3-70b-instruct-fp8-dynamic.json", "vllm-0.19.0-h100-llama33-70b-fp8dyn-tp4", 4, None, 0.01),
    # compressed-tensors W4A16 (int4 groups of 128, Marlin), --dtype float16, vLLM 0.19.0: 5.38 GiB
    ("llama-3.1-8b-instruct-w4a16.json", "vllm-0.19.0-h100-llama31-8b-w4a16", 1, "float16", 0.02),
    # compressed-tensors W8A8 INT8, 2 x H100: 12.11 GiB per rank, the Pixtral vision tower (ignored by the
    # quantisation) in bf16 beside it (vision.py)
    ("mistral-small-3.1-24b-instruct-2503-w8a8.json", "vllm-0.19.0-h100-mistral-small-24b-w8a8-tp2", 2, None, 0.01),
])
def test_checkpoint_weights_against_the_log(preset, case, tp, dtype, within):
    ours, logged = weights_per_rank(config(preset), tp, dtype), logged_weights(case)
    assert abs(ours / logged - 1) <= within, (ours, logged)
    # counted at 16 bits it would be far off: the quantisation is what brings it close
    assert abs(weights_per_rank({k: v for k, v in config(preset).items() if k != "quantization_config"},
                                tp, dtype) / logged - 1) > 0.3


def test_geometry_names_the_quantisation():
    g = geometry_from_config(config("llama-3.1-8b-instruct-w4a16.json"))
    assert g.quantization == "compressed-tensors w4a16" and not g.quantized_fp8
    assert geometry_from_config(config("llama-3.3-70b-instruct-fp8-dynamic.json")).quantized_fp8


# -- what kvprobe refuses rather than guess ----------------------------------------------------------

def test_an_ignore_list_naming_decoder_layers_is_refused():
    cfg = config("llama-3.1-8b-instruct-w4a16.json")
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*self_attn.*"]
    with pytest.raises(ConfigError) as err:
        geometry_from_config(cfg, source="c.json")
    assert err.value.key == "quantization_config.ignore" and "self_attn" in str(err.value)


def test_ignoring_the_router_and_vision_tower_is_accepted():
    cfg = config("llama-3.1-8b-instruct-w4a16.json")
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*mlp.gate$", "re:vision_tower.*", "model.visual.blocks.0"]
    geometry_from_config(cfg, source="c.json")


def test_compressed_tensors_without_a_scheme_is_refused():
    with pytest.raises(ConfigError) as err:
        linear_quant({"quantization_config": {"quant_method": "compressed-tensors"}}, 2, "c.json")
    assert err.value.key == "quantization_config.config_groups"


def test_a_scheme_kvprobe_does_not_count_is_refused():
    cfg = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}}}
    with pytest.raises(ConfigError, match="4-bit float by tensor_group"):
        linear_quant(cfg, 2, "c.json")


def test_the_ledger_names_the_quantisation_it_counted():
    from kvprobe.theory.ledger.build import LedgerInputs, build_ledger
    from kvprobe.theory.ledger.text import render_ledger

    led = build_ledger(LedgerInputs(engine="vllm", model=str(CONFIGS / "llama-3.1-8b-instruct-w4a16.json"),
                                    gpu_memory_bytes=80 * GIB, max_model_len=8192))
    assert "compressed-tensors w4a16 checkpoint" in render_ledger(led)
