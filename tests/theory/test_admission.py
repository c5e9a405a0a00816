"""predict() reproduces the references' admission limits and names the binding limit."""

from __future__ import annotations

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory.admission import POLICIES, policy_for, predict
from kvprobe.theory.schedsim import SglangConfig, VllmConfig
from kvprobe.theory.vllm.admission import vllm_request_blocks

REF = VllmConfig(num_gpu_blocks=1000, block_size=16, max_num_seqs=1024, max_num_batched_tokens=8192,
                 max_model_len=4096)
EX_A = SglangConfig(max_total_num_tokens=16384, context_len=8192)


def test_request_blocks_of_the_worked_example():
    b_adm, b_max, b_avg = vllm_request_blocks(512, 256, 16)
    assert (b_adm, b_max) == (32, 48)
    assert b_avg == pytest.approx(10352 / 256)  # 40.44


def test_vllm_reference_case():
    p = predict(REF, 512, 256)
    assert p.no_preemption_limit == 20
    assert 23.8 <= p.limit <= 24.6
    assert p.binding == "kv" and p.method == "schedsim"
    assert 0.96 <= p.usage_at_limit <= 0.99
    assert (p.blocks_admission, p.blocks_peak) == (32, 48)


def test_vllm_with_users_fills_the_steady_state():
    p20 = predict(REF, 512, 256, users=20)
    assert p20.running == pytest.approx(19.9, abs=0.1) and p20.waiting == 0 and p20.preemption_rate == 0
    p32 = predict(REF, 512, 256, users=32)
    assert p32.waiting == pytest.approx(7.7, abs=0.5) and p32.preemption_rate > 20


def test_vllm_second_shape():
    cfg = VllmConfig(num_gpu_blocks=2000, max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=4096)
    p = predict(cfg, 1000, 100)
    assert p.no_preemption_limit == 28
    assert 29.0 <= p.limit <= 29.8


def test_vllm_seq_limited():
    cfg = VllmConfig(num_gpu_blocks=1000, max_num_seqs=16, max_num_batched_tokens=8192, max_model_len=4096)
    p = predict(cfg, 512, 256, users=20)
    assert (p.limit, p.binding, p.method) == (16, "max_num_seqs", "closed-form")
    assert p.running == pytest.approx(16, abs=0.1) and p.waiting == pytest.approx(4, abs=0.1)
    assert p.usage_at_limit == pytest.approx(0.643, abs=0.01)


def test_token_budget_binds_when_prefill_cannot_keep_up():
    cfg = VllmConfig(num_gpu_blocks=100_000, max_num_seqs=256, max_num_batched_tokens=256, max_model_len=8192)
    p = predict(cfg, 2000, 50)
    assert p.binding == "token_budget"
    assert p.limit < 20


def test_worst_case_policy_reserves_prompt_plus_output():
    p = predict(REF, 512, 256, policy="worst-case")
    assert p.limit == 999 // 48 and p.method == "closed-form"


def test_sglang_example_a():
    p = predict(EX_A, 512, 256)
    assert (p.limit, p.no_preemption_limit, p.binding, p.method) == (21, 21, "kv", "schedsim")
    # the reference's 0.98 is the peak physical usage; the published gauge averages 0.81 (real SGLang
    # 0.5.23's shadow, M=16384 P=512 O=256, read 80.5-80.7% on its saturated levels)
    assert p.blocks_admission == 769 and p.usage_at_limit == pytest.approx(0.81, abs=0.01)


def test_sglang_example_b():
    p = predict(EX_A, 512, 4096)
    # 0.84 is the peak (3 x 4607 / 16384); the gauge, published mostly at decode reports, averages 0.46
    assert p.limit == 3 and p.usage_at_limit == pytest.approx(0.46, abs=0.01)


def test_sglang_max_running_requests_binds():
    cfg = SglangConfig(max_total_num_tokens=16384, context_len=8192, max_running_requests=8)
    p = predict(cfg, 512, 256)
    assert (p.limit, p.binding) == (8, "max_running_requests")


def test_sglang_0521_drifts_above_0522():
    p = predict(EX_A, 512, 256, policy="sglang-0.5.21")
    assert p.method == "schedsim" and p.limit > 21
    assert p.no_preemption_limit == 21


def test_length_limits_raise():
    with pytest.raises(ConfigError, match="max_model_len"):
        predict(REF, 4000, 200)
    with pytest.raises(ConfigError, match="context_len"):
        predict(EX_A, 8000, 191)
    predict(EX_A, 8000, 190)  # P + O = context_len - 2 is fine


def test_policy_for_versions():
    assert policy_for("vllm", "0.33.0") == "vllm-0.33"
    assert policy_for("vllm", "0.11.0") == "vllm-0.11"
    assert policy_for("vllm", "0.33.0", reserve_full_isl=False) == "vllm-0.11"
    assert policy_for("sglang", "0.5.23") == "sglang-0.5.22"
    assert policy_for("sglang", "0.5.21") == "sglang-0.5.21"
    assert set(POLICIES) >= {"vllm-0.33", "worst-case"}
    with pytest.raises(ConfigError):
        policy_for("tgi", "1.0")
