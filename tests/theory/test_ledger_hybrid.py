"""The ledger of hybrid models on vLLM: the pool planned per KV cache group (vllm/hybrid/kv_cache_planning.vllm_kv_plan,
checked against vLLM's planner in test_vllm_kv.py / tests/shadow_env), the per-group breakdown in
text and JSON, the binding limit named by group, and the cases it does not model said plainly."""

from __future__ import annotations

import json

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.ledger.text import render_ledger

GPT_OSS = "openai/gpt-oss-20b"


def ledger(model: str, **kw):
    base = dict(engine="vllm", model=model, max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=2048)
    return build_ledger(LedgerInputs(**{**base, **kw}))


def test_gpt_oss_capacity_line_is_the_sum_over_its_groups():
    """Sync scheduling, 2,048 tokens per step, block 16: a max-length request holds
    cdiv(min(128 - 1 + 2048, 8192), 16) + 1 = 137 blocks of the window group (kv_cache_interface.py
    L917-944) and 8192 / 16 = 512 of the full one; 6,490 blocks are 10 such requests, 81,920 tokens
    (kv_cache_utils.py L1061-1128) — not 6,490 x 16 / 2 tokens as two full groups would give."""
    led = ledger(GPT_OSS, num_gpu_blocks_override=6490, async_scheduling=False)
    c = led.capacity
    assert [(g["group"], g["layers"], g["blocks_per_request"]) for g in c.groups] == [
        ("sliding-window layers (window 128)", 12, 137), ("full layers", 12, 512)]
    assert c.max_concurrency_at_max_model_len == pytest.approx(10.0)
    assert c.kv_tokens == 81920
    assert c.bytes_per_block == 12 * 16 * 8 * (64 + 64) * 2  # 12 layers' pages of one group


def test_gpt_oss_admission_per_group_and_the_full_layers_bind():
    """P = 1000, O = 200: admission needs cdiv(1000, 16) = 63 blocks in each group (the window
    group's cap, 137, does not bite); at its peak the full group holds cdiv(1199, 16) = 75 while
    the window group holds the prompt's 63 only during the prefill. The full layers bind."""
    led = ledger(GPT_OSS, num_gpu_blocks_override=1500, async_scheduling=False, prompt_tokens=1000,
                 output_tokens=200)
    groups = {g["group"]: g for g in led.request.groups}
    window, full = groups["sliding-window layers (window 128)"], groups["full layers"]
    assert (window["blocks_admission"], full["blocks_admission"]) == (63, 63)
    assert (window["blocks_peak"], full["blocks_peak"]) == (63, 75)
    assert window["blocks_mean"] < 12 < full["blocks_mean"]  # the window keeps ~128/16 + 1 blocks
    a = led.admission
    assert a.binding == "kv" and a.binding_group == "full layers"
    # 1,499 usable blocks / ~(9 + 69) blocks per request on average: about 19 at once, well
    # beyond the 1499 // (63 + 75) = 10 a sum-of-peaks count would admit
    assert 10 < a.limit < 25
    # the no-preemption limit a probe is held to is that bound: clean whatever the arrivals' phase
    assert a.no_preemption_limit == 1499 // (63 + 75) == 10
    # but the closed loop holds requests at different moments, each group at its peak at another,
    # and runs clean well above it (checked against vLLM's scheduler in
    # test_real_vllm_hybrid.py::test_the_closed_loop_runs_clean_up_to_the_ledgers_figure_and_no_further)
    assert 10 < a.clean_in_closed_loop <= a.limit + 1
    text = render_ledger(led)
    assert "never waits or preempts" in text and "every request at every group's peak at once" in text
    assert "clean in the closed loop" in text
    assert "binding limit: kv (full layers)" in text
    assert "  sliding-window layers (window 128)" in text and "group: full layers" in text
    out = json.loads(json.dumps(led.to_dict()))
    assert [g["group"] for g in out["capacity"]["groups"]] == ["sliding-window layers (window 128)", "full layers"]
    assert out["admission"]["binding_group"] == "full layers"
    assert [g["blocks_peak"] for g in out["request"]["groups"]] == [63, 75]
    assert "plan" not in out["budget"]


def test_a_window_on_every_layer_binds_by_its_window():
    """Mistral 7B v0.1: one group, window 4096; a request longer than its window holds the window."""
    led = ledger("mistralai/Mistral-7B-v0.1", num_gpu_blocks_override=2000, async_scheduling=False,
                 prompt_tokens=4000, output_tokens=1000)
    (g,) = led.request.groups
    assert g["group"] == "sliding-window layers (window 4096)"
    assert g["blocks_peak"] < -(-4999 // 16)  # blocks that left the window were freed
    assert led.admission.binding_group == g["group"]


def test_qwen3_next_with_mamba_checkpoint_blocks_holds_one_more_state_block_per_group():
    """Prefix caching on (the default for hybrid models) with FlashInfer's GDN prefill: the prompt's
    last chunk holds its running state and the exported checkpoint state in each Mamba group (two
    blocks, vLLM's physical_block_cap 1 + 1), and the planner counts 2 + 1 blocks per max-length
    request (MambaSpec.max_memory_usage_bytes). Prefix caching off ("none" mode): one state block."""
    model = "Qwen/Qwen3-Next-80B-A3B-Instruct"
    led = ledger(model, num_gpu_blocks_override=400, tp=4, prompt_tokens=2000, output_tokens=500)
    out = json.loads(json.dumps(led.to_dict()))
    assert [(g["group"], g["blocks_per_request"]) for g in out["capacity"]["groups"]] == [
        ("linear-attention (Mamba) layers", 9), ("full layers", 26)]
    mamba = {g["group"]: g for g in led.request.groups}["linear-attention (Mamba) layers"]
    assert (mamba["blocks_admission"], mamba["blocks_peak"]) == (6, 6)
    assert led.admission.binding == "kv" and led.admission.binding_group == "full layers"
    led = ledger(model, num_gpu_blocks_override=400, tp=4, prompt_tokens=2000, output_tokens=500,
                 enable_prefix_caching=False)
    groups = {g["group"]: g for g in led.request.groups}
    mamba = groups["linear-attention (Mamba) layers"]
    assert (mamba["copies"], mamba["layers"], mamba["blocks_peak"]) == (3, 36, 3)  # one state block per group
    assert led.admission.binding == "kv" and led.admission.binding_group == "full layers"


def test_a_hybrid_pool_too_small_for_one_request_is_vllms_refusal():
    led = build_ledger(LedgerInputs(engine="vllm", model=GPT_OSS, max_model_len=8192, num_gpu_blocks_override=600,
                                    async_scheduling=False), explain_refusal=True)
    assert led.startup["refused"] and "To serve at least one request with the model's max seq len (8192)" in \
        led.startup["message"]
    with pytest.raises(ConfigError, match="estimated maximum model length"):
        ledger(GPT_OSS, num_gpu_blocks_override=600, async_scheduling=False)
