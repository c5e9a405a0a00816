"""The SGLang shadow's hybrid pieces in kvprobe's own environment (no engine): the pools it predicts
for a launch, the flags it reads, the memory they take, the config SGLang loads on a CPU, and what
the plugin says about a hybrid model in SGLang's log."""

from __future__ import annotations

import pytest

from kvprobe.errors import ConfigError, TargetError
from kvprobe.shadow import sglang_hybrid, sglang_target
from kvprobe.shadow.launch import ShadowLaunch
from kvprobe.theory.geometry import geometry_from_config, load_model_config

GPT_OSS, QWEN_NEXT = "openai/gpt-oss-20b", "Qwen/Qwen3-Next-80B-A3B-Instruct"


def _req(model: str, flags: dict, **changes) -> ShadowLaunch:
    config, _ = load_model_config(model)
    return ShadowLaunch(engine="sglang", version="0.5.23", model=model, config=config, served_model_name=model,
                        flags=flags, **changes)


def test_window_pools_for_a_launch():
    req = _req(GPT_OSS, {"max-total-tokens": 4096, "context-length": 2048})
    pools, flags = sglang_target.hybrid_launch(req, req.flags)
    assert (pools.max_total_num_tokens, pools.swa_tokens, pools.max_running_requests) == (4096, 3276, 2048)
    # 12 full + 12 window layers of 8 KV heads x 64 x 2 (K, V) x 2 bytes: the buffers SGLang allocates
    # ("Full KV Cache ... K size: 0.05 GB", "SWA KV Cache ... 0.04 GB")
    assert sglang_hybrid.pool_bytes(pools) == (4096 + 3276) * 12 * 8 * 64 * 2 * 2
    assert flags["chunked-prefill-size"] == 4096 and flags["device"] == "cpu"


def test_flags_reach_the_prediction_by_sglangs_names():
    req = _req(GPT_OSS, {"max-total-tokens": 4096, "context-length": 2048, "swa-full-tokens-ratio": "0.5"})
    pools, _ = sglang_target.hybrid_launch(req, req.flags)
    assert pools.swa_tokens == 2048
    with pytest.raises(ConfigError, match="flags.swa-full-tokens-ratio: expected float, got 'half'"):
        sglang_hybrid.options({"swa-full-tokens-ratio": "half"})
    assert sglang_hybrid.options({"disable-radix-cache": True, "max-mamba-cache-size": "12"}).max_mamba_cache_size == 12


def test_state_slots_for_a_launch():
    req = _req(QWEN_NEXT, {"max-total-tokens": 4096, "context-length": 2048, "max-mamba-cache-size": 12,
                           "mamba-radix-cache-strategy": "no_buffer", "disable-overlap-schedule": True})
    pools, _ = sglang_target.hybrid_launch(req, req.flags)
    assert (pools.mamba_slots, pools.max_running_requests) == (12, 4)  # 3 slots per request (no_buffer)
    assert pools.layout.mamba_cache_per_req == 77266944  # "mamba state: 12 slots of 77266944 bytes"
    assert sglang_hybrid.pool_bytes(pools) == 4096 * pools.full_bytes_per_token + 13 * 77266944


def test_state_slots_need_a_size_without_a_gpu():
    req = _req(QWEN_NEXT, {"max-total-tokens": 4096, "context-length": 2048})
    with pytest.raises(ConfigError, match="needs --max-mamba-cache-size"):
        sglang_target.hybrid_launch(req, req.flags)


def test_hybrid_pools_need_the_full_pools_size_and_no_declared_gpu_yet():
    req = _req(GPT_OSS, {"context-length": 2048})
    with pytest.raises(ConfigError, match=r"12 full, 12 sliding \(window 128\)\) needs the full pool's size"):
        sglang_target.hybrid_launch(req, req.flags)
    req = _req(GPT_OSS, {"context-length": 2048}, gpu_memory_bytes=80 * 2**30)
    with pytest.raises(ConfigError, match="sizes a hybrid model's pools from flags.max-total-tokens only") as err:
        sglang_target.hybrid_launch(req, req.flags)
    assert err.value.key == "hardware.gpu_memory"


def test_a_pool_that_does_not_fit_names_the_full_pool():
    req = _req(QWEN_NEXT, {"max-total-tokens": 4096, "context-length": 2048, "max-mamba-cache-size": 400})
    with pytest.raises(TargetError, match="does not fit in this machine's memory: its KV pool of 4096 tokens"):
        sglang_target.hybrid_launch(req, req.flags)  # 401 x 74 MiB of state slots


def test_a_full_attention_model_is_not_hybrid():
    req = _req("meta-llama/Llama-3.1-8B", {"max-total-tokens": 16384})
    assert sglang_target.hybrid_launch(req, req.flags) is None


def test_mxfp4_is_left_out_of_the_config_sglang_loads_on_a_cpu():
    config, _ = load_model_config(GPT_OSS)
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    loaded = sglang_hybrid.engine_config(config)
    assert "quantization_config" not in loaded and loaded["layer_types"] == config["layer_types"]
    llama, _ = load_model_config("meta-llama/Llama-3.1-8B")
    assert sglang_hybrid.engine_config(llama) is llama
    g = geometry_from_config(loaded, GPT_OSS)
    assert sglang_hybrid.is_hybrid(g)


def test_worker_log_of_a_hybrid_model():
    text = "\n".join([
        "[2026-12-01 18:05:12] kvprobe shadow: sliding window: 127 (GptOssForCausalLM)",
        "[2026-12-01 18:06:30] kvprobe shadow: mamba state: 24 slots of 77266944 bytes",
    ])
    assert sglang_target.parse_worker_log(text) == {"sliding_window": 127, "mamba_slots": 24,
                                                    "mamba_cache_per_req": 77266944}


def test_the_console_names_the_pools_beside_the_full_one():
    from pathlib import Path

    from kvprobe.shadow.sglang_cli import _hybrid_pools

    published = Path(__file__).resolve().parents[1] / "engines" / "published"
    assert _hybrid_pools(str(published / "sglang-0.5.23-gpt-oss-20b-startup.log")) == \
        " (full layers; window pool 3276 tokens)"
    assert _hybrid_pools(str(published / "sglang-0.5.23-qwen3-next-startup.log")) == \
        " (full layers; 24 recurrent-state slots)"
    assert _hybrid_pools(str(published / "sglang-0.5.23-unknown-flag.log")) == ""
