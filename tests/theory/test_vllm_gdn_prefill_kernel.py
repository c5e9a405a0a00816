"""The card decides a Gated DeltaNet layer's checkpoint block: 0.33.0's layer takes one only with FlashInfer's
prefill kernel (qwen_gdn_linear_attn.py L688-696), which vLLM picks on a Hopper, or a Blackwell at head_k_dim 128
(`_resolve_gdn_prefill_backend`; that choice against vLLM's own function on every card family:
tests/shadow_env/test_hybrid_vllm.py). So Qwen3-Next on an A100 or an L4 plans 0.32.0's two state blocks and
544-token blocks, and the ledger, the emulator and the shadow worker each take the declared card's kernel."""

from __future__ import annotations

import pytest

from kvprobe.engines import get_dialect
from kvprobe.errors import ConfigError
from kvprobe.spec.expectation import load_expectations
from kvprobe.targets.emulator.app import hybrid_plan
from kvprobe.targets.engine import emulator_argv
from kvprobe.targets.shadow.vllm.target import worker_settings
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.vllm.hybrid.kv_cache_spec import MAMBA_SPEC

QWEN3_NEXT = "Qwen/Qwen3-Next-80B-A3B-Instruct"


def _ledger(version="0.33.0", **kw):
    return build_ledger(LedgerInputs(engine="vllm", model=QWEN3_NEXT, engine_version=version,
                                     num_gpu_blocks_override=3000, max_model_len=32768, max_num_batched_tokens=2048,
                                     **kw))


def _mamba_blocks(led) -> int:
    """Blocks one request holds in a Mamba group (its state blocks and any checkpoint block)."""
    return next(g["blocks_per_request"] for g in led.capacity.groups if "Mamba" in g["group"])


def _rule(led) -> str:
    return dict(led.release_rules)["Mamba checkpoint blocks"]


# Qwen3-Next's three Mamba groups of 12 layers: 3 x 3 blocks a request with the checkpoint, 3 x 2 without
@pytest.mark.parametrize(("card", "kernel", "block", "blocks"), [
    ({}, "FlashInfer", 576, 9),  # no card: a Hopper, the ledger's default
    ({"gpu_capability": "9.0"}, "FlashInfer", 576, 9),
    ({"gpu_capability": "8.0"}, "Triton/FLA", 544, 6),  # A100
    ({"gpu_capability": "8.9"}, "Triton/FLA", 544, 6),  # L4, L40S
    ({"gpu_arch": "sm89"}, "Triton/FLA", 544, 6),  # the family alone
    ({"gpu_capability": "10.0"}, "FlashInfer", 576, 9),  # Blackwell, Qwen3-Next's head_k_dim 128
    ({"gpu_capability": "9.0", "gdn_prefill_backend": "triton"}, "Triton/FLA", 544, 6),
    ({"gpu_capability": "8.0", "gdn_prefill_backend": "flashinfer"}, "Triton/FLA", 544, 6),  # asked, not run
])
def test_the_checkpoint_block_is_the_cards_kernels(card, kernel, block, blocks):
    led = _ledger(**card)
    assert led.capacity.block_size == block
    assert _mamba_blocks(led) == blocks
    assert kernel in _rule(led)
    assert ("no checkpoint block" in _rule(led)) == (blocks == 6)


def test_before_0_33_the_card_changes_nothing():
    hopper, ampere = _ledger("0.32.0", gpu_capability="9.0"), _ledger("0.32.0", gpu_capability="8.0")
    assert (hopper.capacity.block_size, _mamba_blocks(hopper)) == (ampere.capacity.block_size, _mamba_blocks(ampere))
    assert _mamba_blocks(ampere) == 6 and "before 0.33.0" in _rule(ampere)


@pytest.mark.parametrize("asked", ["sycl", "aiter_flydsl", "cuda"])
def test_a_kernel_a_cuda_gpu_cannot_run_is_refused(asked):
    with pytest.raises(ConfigError) as err:
        _ledger(gdn_prefill_backend=asked)
    assert err.value.key == "gdn_prefill_backend"


def test_without_gdn_layers_the_flag_is_not_read():
    led = build_ledger(LedgerInputs(engine="vllm", model="openai/gpt-oss-20b", engine_version="0.33.0",
                                    num_gpu_blocks_override=3000, max_model_len=8192, gdn_prefill_backend="sycl"))
    assert led.capacity.num_blocks > 0


EXPECTATION = """
engine: vllm
version: "0.33.0"
model: Qwen/Qwen3-Next-80B-A3B-Instruct
hardware: {gpu: A100-80GB, count: 4}
target: {launch: emulator}
flags: {num-gpu-blocks-override: 2000, max-model-len: 4096, tensor-parallel-size: 4}
profile:
  request: {prompt_tokens: 512, output_tokens: 64}
  ramp: {strategy: explicit, levels: [4]}
  hold: {lifetimes: 2, warmup: 0.5}
"""


def test_the_emulator_and_the_shadow_worker_are_told_the_declared_card(tmp_path):
    path = tmp_path / "a100.yaml"
    path.write_text(EXPECTATION)
    [exp] = load_expectations(path)
    assert exp.hardware.capability == "8.0"
    argv = emulator_argv(exp, get_dialect("vllm"), port=1)
    assert argv[argv.index("--gpu-capability") + 1] == "8.0"
    assert worker_settings(dict(exp.flags), None, {}, "0.33.0", exp.hardware.capability).gpu_capability == "8.0"
    flags = {"block-size": 16, "max-num-batched-tokens": 2048, "enable-prefix-caching": True, "max-model-len": 4096,
             "kv-cache-dtype": "auto"}
    plans = {cap: hybrid_plan(QWEN3_NEXT, flags, 2000, True, "0.33.0", cap) for cap in ("8.0", None)}
    ckpt = {cap: {s.num_prefill_checkpoint_blocks for s in plan.specs if s.spec == MAMBA_SPEC}
            for cap, plan in plans.items()}
    assert ckpt == {"8.0": {0}, None: {1}}  # the emulator without a card: a Hopper, as the ledger
