"""The ledger of hybrid models on SGLang 0.5.23: the full and window pools sized from one budget
(sglang_pools, checked against SGLang's configurator in tests/shadow_env/test_hybrid_sglang.py), the
per-pool breakdown in text and JSON, the binding pool named, and what it does not model said plainly.
Admission is sglang/swa/scheduler.py (the radix cache off) and sglang/swa/radix.py (on), checked
against SGLang's own Scheduler in test_real_sglang.py."""

from __future__ import annotations

import json
import re

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.ledger.text import render_ledger

GPT_OSS = "openai/gpt-oss-20b"
GIB = 2**30


def ledger(model: str = GPT_OSS, **kw):
    base = dict(engine="sglang", model=model, context_length=8192, disable_radix_cache=True)
    return build_ledger(LedgerInputs(**{**base, **kw}))


def test_gpt_oss_pools_split_one_budget_by_the_ratio():
    """--max-total-tokens 100,000 (radix off, no --max-running-requests): the full pool is the cap and
    the window pool int(100,000 x 0.8) = 80,000 (HybridSWAPoolConfigurator.calculate_pool_sizes_
    from_max_tokens); each holds 12 layers of 8 KV heads x 64 x 2 (K, V) x 2 bytes = 2,048 B."""
    led = ledger(max_total_tokens=100000)
    assert [(g["group"], g["tokens"], g["layers"], g["bytes_per_token"]) for g in led.capacity.groups] == [
        ("full pool", 100000, 12, 12 * 2048), ("swa pool (window 127)", 80000, 12, 12 * 2048)]
    assert led.capacity.kv_tokens == 100000
    cfg = led.scheduler_config
    assert (cfg.sliding_window_size, cfg.swa_pool_tokens) == (127, 80000)


def test_the_window_pool_binds_and_is_named():
    """A window pool of int(100,000 x 0.02) = 2,000 tokens: a request holds its 1,500-token prompt
    in the window pool until its second decode step, so about 4 run at once although the full pool
    holds 40 of them; the window pool refuses the admissions and is named."""
    led = ledger(max_total_tokens=100000, swa_full_tokens_ratio=0.02, prompt_tokens=1500, output_tokens=1000)
    a = led.admission
    assert a.binding == "kv" and a.binding_group == "swa pool (window 127)"
    assert 2 <= a.limit <= 5
    window = {g["group"]: g for g in led.request.groups}["swa pool (window 127)"]
    # estimate_swa_kv_tokens: (1500 - 127) + min(2500, 127) + 1 page; held: the prompt and 1 in flight
    assert (window["blocks_admission"], window["blocks_peak"]) == (1501, 1501)
    assert window["blocks_mean"] < 2 * 127 + 2  # after its prompt leaves, at most window + 129
    text = render_ledger(led)
    assert "binding limit: kv (swa pool (window 127))" in text
    assert "  swa pool (window 127)          1501 / 1501" in text


def test_the_full_pool_binds_and_the_json_has_both_pools():
    led = ledger(max_total_tokens=30000, prompt_tokens=2000, output_tokens=1000, users=20)
    a = led.admission
    assert a.binding == "kv" and a.binding_group == "full pool"
    assert 9 <= a.limit <= 10  # 30,000 // 3,001 reserved; the window pool (24,000) has room
    out = json.loads(json.dumps(led.to_dict()))
    assert [(g["group"], g["tokens"]) for g in out["capacity"]["groups"]] == [
        ("full pool", 30000), ("swa pool (window 127)", 24000)]
    assert [g["group"] for g in out["request"]["groups"]] == ["full pool", "swa pool (window 127)"]
    assert [g["group"] for g in out["admission"]["groups"]] == ["full pool", "swa pool (window 127)"]
    assert out["admission"]["binding_group"] == "full pool"
    assert out["scheduler_config"]["swa_pool_tokens"] == 24000
    assert "pools" not in out["budget"]


def test_from_gpu_memory_the_window_pool_takes_its_share_of_the_bytes():
    """full = bytes / (12 x 2048 + 0.8 x 12 x 2048) tokens, window = 0.8 of it (L907-916)."""
    led = ledger(gpu_memory_bytes=80 * GIB)
    kv = led.budget.kv_pool_bytes
    full, window = (g["tokens"] for g in led.capacity.groups)
    assert full == int(kv // (12 * 2048 * 1.8)) and window == int(full * 0.8)


def test_the_radix_cache_on_is_predicted_with_its_window_freed_after_the_prefill():
    """SGLang's default (the radix cache on): predicted by sched_sglang_swa_radix (checked against
    SGLang's Scheduler in test_real_sglang.py). A prefill's window beyond the locked trailing window
    is evictable once its result is in (radix off: freed at its second decode step, and then only
    every 128 tokens), so one request of 1000 + 100 holds fewer window slots on average."""
    on = ledger(max_total_tokens=100000, disable_radix_cache=False, prompt_tokens=1000, output_tokens=100)
    off = ledger(max_total_tokens=100000, prompt_tokens=1000, output_tokens=100)
    assert on.not_predicted is None and on.admission is not None and on.admission.binding == "kv"
    assert [g["tokens"] for g in on.capacity.groups] == [100000, 80000]
    win_on, win_off = (led.request.groups[1] for led in (on, off))
    assert win_on["blocks_admission"] == win_off["blocks_admission"] == (1000 - 127) + 127 + 1  # the same charge
    assert win_on["blocks_peak"] == 1000 and win_off["blocks_peak"] == 1001  # the prompt (and off: its first decode)
    assert win_on["blocks_mean"] == 183.4 and win_off["blocks_mean"] == 192.04  # one request alone
    assert "admission: not predicted" not in render_ledger(on)


def test_the_radix_cache_on_says_when_it_leaves_what_is_modelled():
    """A window pool so small that running windows outgrow it: retracted requests come back to their
    prompt still in the tree, which SGLang re-adopts in a way not modelled: not predicted, naming the
    flag; and a shared prefix on the radix cache is not modelled either."""
    led = ledger(max_total_tokens=20000, disable_radix_cache=False, swa_full_tokens_ratio=0.1, prompt_tokens=300,
                 output_tokens=400)
    assert led.admission is None and "re-adopts" in led.not_predicted and "--disable-radix-cache" in led.not_predicted
    assert "admission: not predicted (disable_radix_cache: with SGLang's radix cache on" in render_ledger(led)
    shared = ledger(max_total_tokens=100000, disable_radix_cache=False, prompt_tokens=1000, output_tokens=100,
                    shared_prefix_tokens=100)
    assert shared.admission is None and "shared prompt prefix" in shared.not_predicted


QWEN3_NEXT = "Qwen/Qwen3-Next-80B-A3B-Instruct"


def test_qwen3_next_radix_off_one_state_slot_per_request():
    """--disable-radix-cache --max-running-requests 64: 64 state slots (one per request), the full
    pool over the 12 full-attention layers (of 48) from what the slots leave; the slots bind
    (the plain scheduler on the full pool, checked against SGLang's in test_real_sglang.py)."""
    led = ledger(QWEN3_NEXT, gpu_memory_bytes=80 * GIB, tp=4, max_running_requests=64, prompt_tokens=2000,
                 output_tokens=500, users=80)
    full, slots = led.capacity.groups
    assert (full["group"], full["layers"], full["tokens"]) == ("full pool", 12, led.capacity.kv_tokens)
    assert (slots["group"], slots["layers"], slots["slots"]) == ("mamba state slots", 36, 64)
    assert led.budget.max_running_requests == 64 and led.scheduler_config.sliding_window_size is None
    a = led.admission
    assert a.binding == "max_running_requests" and a.limit == 64 and a.waiting > 10
    out = json.loads(json.dumps(led.to_dict()))
    assert out["capacity"]["groups"][1]["bytes_per_slot"] == led.budget.pools.layout.mamba_cache_per_req
    assert re.search(r"  mamba state slots +64  slots, one per running request; 36 layers", render_ledger(led))


def test_qwen3_next_radix_on_is_sized_not_predicted():
    led = ledger(QWEN3_NEXT, gpu_memory_bytes=80 * GIB, tp=4, disable_radix_cache=False, prompt_tokens=2000,
                 output_tokens=500)
    assert led.admission is None and "recurrent-state (Mamba)" in led.not_predicted
    assert "--disable-radix-cache" in led.not_predicted and led.capacity.groups[1]["slots"] > 0


def test_qwen3_next_radix_off_without_a_budget_names_the_key():
    with pytest.raises(ConfigError) as err:
        ledger(QWEN3_NEXT, max_total_tokens=100000)
    assert err.value.key == "max_mamba_cache_size"


@pytest.mark.parametrize("model", ["mistralai/Mistral-7B-v0.1", "google/gemma-3-27b-it"])
def test_windows_sglang_pools_as_full_get_one_pool(model):
    """SGLang 0.5.23 keeps every layer of Mistral v0.1 and Gemma 3 in one full pool (not hybrid-SWA
    architectures, or turned off for Gemma): the uniform budget is SGLang's own (Mistral's admission
    checked against SGLang's Scheduler in test_real_sglang.py)."""
    led = ledger(model, max_total_tokens=50000, prompt_tokens=1000, output_tokens=100)
    assert led.capacity.groups == [] and led.capacity.kv_tokens == 50000
    assert led.scheduler_config.sliding_window_size is None


def test_qwen3_next_no_buffer_is_the_plain_radix_scheduler():
    """The radix cache on with no_buffer (overlap off): 3 slots per request; predicted when no
    prompt prefix is shared, not predicted when one is; SGLang's own refusals of no_buffer kept."""
    kw = dict(gpu_memory_bytes=80 * GIB, tp=4, max_running_requests=64, disable_radix_cache=False,
              mamba_radix_cache_strategy="no_buffer", disable_overlap_schedule=True, prompt_tokens=2000,
              output_tokens=500)
    led = ledger(QWEN3_NEXT, **kw)
    assert led.capacity.groups[1]["slots"] >= 3 * 64 and led.admission.limit == 64
    assert led.scheduler_config.overlap is False and not led.scheduler_config.disable_radix_cache
    led = ledger(QWEN3_NEXT, **kw, shared_prefix_tokens=500)
    assert led.admission is None and "shared prompt prefix" in led.not_predicted
    with pytest.raises(ConfigError, match="no_buffer only supports page_size=1") as err:
        ledger(QWEN3_NEXT, **kw, page_size=16)
    assert err.value.key == "page_size"
    with pytest.raises(ConfigError, match="no_buffer do not support overlap schedule") as err:
        ledger(QWEN3_NEXT, **{**kw, "disable_overlap_schedule": False})


def test_every_hybrid_pool_flag_reaches_the_ledger_as_it_reaches_sglang():
    """The flags an expectation or `kvprobe ledger` gives (the dialect's Flag.ledger mapping) set the
    ledger's pools as they set the shadow's prediction and SGLang's (the shadow passes them to SGLang
    as written): --max-mamba-cache-size 40 caps max_running_requests at 40 with the radix cache off
    (resolve_max_num_reqs; sglang_pools is checked against SGLang's configurator in
    tests/shadow_env/test_hybrid_sglang.py)."""
    from kvprobe.spec.flags import flag_ledger_kwargs
    from kvprobe.targets.shadow.sglang.hybrid import options

    flags = {"max-mamba-cache-size": 40, "mamba-full-memory-ratio": 0.5, "disable-radix-cache": True,
             "max-running-requests": 64, "disable-overlap-schedule": True, "mamba-ssm-dtype": "bfloat16"}
    led = ledger(QWEN3_NEXT, gpu_memory_bytes=80 * GIB, tp=4, prompt_tokens=2000, output_tokens=500,
                 **flag_ledger_kwargs("sglang", flags))
    assert led.capacity.groups[1]["slots"] == 40 and led.budget.max_running_requests == 40
    assert led.scheduler_config.overlap is False
    opts = options({**flags, "tp-size": 4})
    assert (opts.max_mamba_cache_size, opts.mamba_full_memory_ratio, opts.mamba_ssm_dtype) == (40, 0.5, "bfloat16")
    # the state dtype changes the bytes of a slot: bfloat16 halves the float32 recurrent state
    f32 = ledger(QWEN3_NEXT, gpu_memory_bytes=80 * GIB, tp=4, prompt_tokens=2000, output_tokens=500,
                 **flag_ledger_kwargs("sglang", {**flags, "mamba-ssm-dtype": "float32"}))
    assert f32.capacity.groups[1]["bytes_per_slot"] > led.capacity.groups[1]["bytes_per_slot"]
