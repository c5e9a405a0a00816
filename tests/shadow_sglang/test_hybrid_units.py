"""The SGLang shadow's hybrid pieces in kvprobe's own environment (no engine): the pools it predicts
for a launch, the flags it reads, the memory they take, the config SGLang loads on a CPU, and what
the plugin says about a hybrid model in SGLang's log."""

from __future__ import annotations

import pytest

from kvprobe.errors import ConfigError, TargetError
from kvprobe.targets.shadow.launch import ShadowLaunch
from kvprobe.targets.shadow.sglang import hybrid as sglang_hybrid
from kvprobe.targets.shadow.sglang import target as sglang_target
from kvprobe.theory.model.geometry import geometry_from_config, load_model_config

GPT_OSS, QWEN_NEXT = "openai/gpt-oss-20b", "Qwen/Qwen3-Next-80B-A3B-Instruct"


def _req(model: str, flags: dict, **changes) -> ShadowLaunch:
    config, _ = load_model_config(model)
    return ShadowLaunch(engine="sglang", version="0.5.23", model=model, config=config, served_model_name=model,
                        flags=flags, **changes)


def _pools(req: ShadowLaunch):
    bud, per_token = sglang_target.shadow_budget(req, sglang_target._normalized_flags(req.flags))
    return bud, sglang_target.memory_needed(bud, per_token)


def test_window_pools_for_a_launch():
    req = _req(GPT_OSS, {"max-total-tokens": 4096, "context-length": 2048})
    bud, need = _pools(req)
    pools = bud.pools
    assert (pools.max_total_num_tokens, pools.swa_tokens, bud.max_running_requests) == (4096, 3276, 2048)
    # 12 full + 12 window layers of 8 KV heads x 64 x 2 (K, V) x 2 bytes: the buffers SGLang allocates
    # ("SWAKVPool mem usage: 0.17 GB, swa size: 3276, full size: 4096")
    assert need["kv_pool"] == (4096 + 3276) * 12 * 8 * 64 * 2 * 2
    assert sglang_target._shadow_flags(req, req.flags, bud)["chunked-prefill-size"] == 4096


def test_flags_reach_the_prediction_by_sglangs_names():
    bud, _ = _pools(_req(GPT_OSS, {"max-total-tokens": 4096, "context-length": 2048, "swa-full-tokens-ratio": 0.5}))
    assert bud.pools.swa_tokens == 2048
    with pytest.raises(ConfigError, match="flags.swa-full-tokens-ratio: expected float, got 'half'"):
        sglang_hybrid.options({"swa-full-tokens-ratio": "half"})
    assert sglang_hybrid.options({"disable-radix-cache": True, "max-mamba-cache-size": "12"}).max_mamba_cache_size == 12


def test_state_slots_for_a_launch():
    req = _req(QWEN_NEXT, {"max-total-tokens": 4096, "context-length": 2048, "max-mamba-cache-size": 12,
                           "mamba-radix-cache-strategy": "no_buffer", "disable-overlap-schedule": True})
    bud, need = _pools(req)
    assert (bud.pools.mamba_slots, bud.max_running_requests) == (12, 4)  # 3 slots per request (no_buffer)
    assert bud.pools.layout.mamba_cache_per_req == 77266944  # "mamba state: 12 slots of 77266944 bytes"
    assert need["kv_pool"] == 4096 * bud.pools.full_bytes_per_token + 13 * 77266944
    bud, _ = _pools(_req(QWEN_NEXT, {"max-total-tokens": 4096, "context-length": 2048, "max-running-requests": 8,
                                     "disable-radix-cache": True}))
    assert (bud.pools.mamba_slots, bud.max_running_requests) == (8, 8)  # radix off: a slot per request


def test_state_slots_need_a_size_without_a_gpu():
    with pytest.raises(ConfigError, match="needs --max-mamba-cache-size"):
        _pools(_req(QWEN_NEXT, {"max-total-tokens": 4096, "context-length": 2048}))


def test_a_declared_gpu_sizes_both_pools_from_its_budget():
    """The plugin hands SGLang the declared card's KV bytes; SGLang's configurator splits them between
    the full and the window pool as the ledger does (sglang_budget with the model's config)."""
    req = _req(GPT_OSS, {"context-length": 2048, "mem-fraction-static": 0.9}, gpu_memory_bytes=48 * 2**30)
    bud, need = _pools(req)
    per_token = 12 * 8 * 64 * 2 * 2
    assert bud.pools.max_total_num_tokens == int(bud.kv_pool_bytes // (per_token + 0.8 * per_token))
    assert bud.pools.swa_tokens == int(bud.pools.max_total_num_tokens * 0.8)
    assert sglang_target._shadow_flags(req, req.flags, bud)["mem-fraction-static"] == 0.9
    assert need["kv_pool"] == (bud.pools.max_total_num_tokens + bud.pools.swa_tokens) * per_token


def test_a_declared_gpu_is_sized_as_the_real_sglang_sized_it():
    """Recorded from `kvprobe shadow sglang --model-path openai/gpt-oss-20b --gpu-memory 20GiB
    --mem-fraction-static 0.85 --context-length 2048 --disable-radix-cache` (SGLang's configurator
    given the plugin's 20 x 0.85 - 12.82 GiB of MXFP4 weights = 4.18 GiB): the same full pool,
    window pool and max_running_requests."""
    from pathlib import Path

    from kvprobe.engines import sglang as dialect

    log = (Path(__file__).resolve().parents[1] / "engines" / "published" /
           "sglang-0.5.23-gpt-oss-20b-gpu20-startup.log").read_text()
    req = _req(GPT_OSS, {"context-length": 2048, "mem-fraction-static": 0.85, "disable-radix-cache": True},
               gpu_memory_bytes=20 * 2**30)
    bud, _ = _pools(req)
    logged, rep = dialect.parse_hybrid_startup(log), dialect.parse_startup_log(log)
    assert (logged["full_tokens"], logged["swa_tokens"], rep.max_running) == \
        (bud.pools.max_total_num_tokens, bud.pools.swa_tokens, bud.max_running_requests) == (101552, 81241, 4096)
    assert sglang_target.parse_worker_log(log)["pool_sizing"].endswith(
        f"mem_fraction_static 0.85 -> KV budget {bud.kv_pool_bytes / 2**30:.2f} GiB")


def test_chunked_local_attention_is_sized_as_the_real_sglang_sized_it():
    """Llama 4 Scout: SGLang windows every layer but each 4th by attention_chunk_size (8192), read from
    the config (the model class has no window method). Recorded from `kvprobe shadow sglang
    --model-path meta-llama/Llama-4-Scout-17B-16E-Instruct --max-total-tokens 12000 --context-length
    2048` (4,096 would be refused: a window pool of 3,276 cannot hold the 8,193-token floor)."""
    from pathlib import Path

    from kvprobe.engines import sglang as dialect

    log = (Path(__file__).resolve().parents[1] / "engines" / "published" /
           "sglang-0.5.23-llama-4-scout-startup.log").read_text()
    bud, need = _pools(_req("meta-llama/Llama-4-Scout-17B-16E-Instruct",
                            {"max-total-tokens": 12000, "context-length": 2048}))
    logged, rep = dialect.parse_hybrid_startup(log), dialect.parse_startup_log(log)
    assert (logged["full_tokens"], logged["swa_tokens"], rep.max_running) == \
        (bud.pools.max_total_num_tokens, bud.pools.swa_tokens, bud.max_running_requests) == (12000, 9600, 3000)
    assert sglang_target.parse_worker_log(log)["sliding_window"] == bud.pools.layout.sliding_window_size == 8192
    assert need["kv_pool"] == (12000 * 12 + 9600 * 36) * 8 * 128 * 2 * 2  # "SWAKVPool mem usage: 1.87 GB"
    with pytest.raises(ConfigError, match=r"SWA pool \(3276 tokens\) cannot hold even one request"):
        _pools(_req("meta-llama/Llama-4-Scout-17B-16E-Instruct", {"max-total-tokens": 4096, "context-length": 2048}))


def test_hybrid_pools_need_a_size():
    with pytest.raises(ConfigError, match="needs the pool's size: flags.max-total-tokens, or a declared GPU"):
        _pools(_req(GPT_OSS, {"context-length": 2048}))


def test_a_pool_that_does_not_fit_names_the_full_pool():
    req = _req(QWEN_NEXT, {"max-total-tokens": 4096, "context-length": 2048, "max-mamba-cache-size": 400})
    bud, need = _pools(req)  # 401 x 74 MiB of state slots
    with pytest.raises(TargetError, match="does not fit in this machine's memory: its KV pool of 4096 tokens"):
        sglang_target.check_memory(need, bud, available=16 * 2**30)


def test_a_full_attention_model_has_one_pool():
    bud, _ = _pools(_req("meta-llama/Llama-3.1-8B", {"max-total-tokens": 16384}))
    assert bud.pools is None


def test_mxfp4_is_left_out_of_the_config_sglang_loads_on_a_cpu():
    config, _ = load_model_config(GPT_OSS)
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    loaded = sglang_hybrid.engine_config(config)
    assert "quantization_config" not in loaded and loaded["layer_types"] == config["layer_types"]
    llama, _ = load_model_config("meta-llama/Llama-3.1-8B")
    assert sglang_hybrid.engine_config(llama) is llama
    assert geometry_from_config(loaded, GPT_OSS).layers.hybrid


def test_worker_log_of_a_hybrid_model():
    text = "\n".join([
        "[2026-12-01 18:05:12] kvprobe shadow: sliding window: 127 "
        "(GptOssForCausalLM.get_attention_sliding_window_size)",
        "[2026-12-01 18:06:30] kvprobe shadow: mamba state: 24 slots of 77266944 bytes",
    ])
    assert sglang_target.parse_worker_log(text) == {"sliding_window": 127, "mamba_slots": 24,
                                                    "mamba_cache_per_req": 77266944}


def test_the_console_names_the_pools_beside_the_full_one():
    from pathlib import Path

    from kvprobe.cli.shadow_sglang import _hybrid_pools

    published = Path(__file__).resolve().parents[1] / "engines" / "published"
    assert _hybrid_pools(str(published / "sglang-0.5.23-gpt-oss-20b-startup.log")) == \
        " (full layers; window pool 3276 tokens)"
    assert _hybrid_pools(str(published / "sglang-0.5.23-qwen3-next-startup.log")) == \
        " (full layers; 24 recurrent-state slots)"
    assert _hybrid_pools(str(published / "sglang-0.5.23-unknown-flag.log")) == ""
