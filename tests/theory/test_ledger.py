"""The ledger: every contract key, seed numbers end to end, impossible settings refused."""

import json

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.ledger.text import render_ledger

GIB = 2**30
NO_ESTIMATES = {"activation_bytes": 0, "cudagraph_bytes": 0, "other_bytes": 0}
CONTRACT_KEYS = {
    "model": {"kv_bytes_per_token", "weight_bytes"},
    "budget": {"total_bytes", "fraction", "kv_pool_bytes", "kv_pool_bytes_upper"},
    "capacity": {"num_blocks", "block_size", "bytes_per_block", "kv_tokens", "kv_tokens_upper",
                 "max_concurrency_at_max_model_len"},
    "request": {"blocks_admission", "blocks_peak"},
}


def llama(engine="vllm", **kw):
    base = dict(engine=engine, model="meta-llama/Llama-3.1-8B", gpu_memory_bytes=24 * GIB)
    if engine == "vllm":
        base["max_model_len"] = 8192
    else:
        base["context_length"] = 8192
    base.update(kw)
    return build_ledger(LedgerInputs(**base))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_to_dict_has_every_contract_key_and_is_json(engine):
    d = llama(engine, prompt_tokens=512, output_tokens=256).to_dict()
    for section, keys in CONTRACT_KEYS.items():
        assert keys <= set(d[section]), (section, keys - set(d[section]))
    assert json.loads(json.dumps(d)) == d


def test_vllm_seed001_through_the_ledger():
    d = llama(estimates=NO_ESTIMATES, prompt_tokens=512, output_tokens=256).to_dict()
    assert d["model"]["kv_bytes_per_token"] == 131072 and d["model"]["weight_bytes"] == 16_060_522_496
    assert d["budget"]["fraction"] == 0.92
    c = d["capacity"]
    assert (c["num_blocks"], c["kv_tokens"], c["kv_tokens_upper"]) == (3646, 58_336, 58_347)
    assert f"{c['max_concurrency_at_max_model_len']:.2f}" == "7.12"
    assert (d["request"]["blocks_admission"], d["request"]["blocks_peak"]) == (32, 48)


def test_vllm_estimates_shrink_the_pool_but_not_the_upper_bound():
    plain = llama().to_dict()
    assert plain["capacity"]["kv_tokens_upper"] == 58_347
    assert plain["capacity"]["num_blocks"] < 3646
    assert set(plain["budget"]["estimates"]) == {"activation_bytes", "cudagraph_bytes", "other_bytes"}
    given = llama(estimates={"activation_bytes": GIB}).to_dict()["budget"]
    assert given["activation"] == GIB and "activation_bytes" not in given["estimates"]


def test_sglang_seed001_through_the_ledger():
    led = llama("sglang", context_length=None)
    d = led.to_dict()
    assert d["budget"]["fraction"] == 0.704 and d["budget"]["reserved_mib"] == 7280
    assert d["capacity"]["kv_tokens"] == 15_879
    assert d["budget"]["max_running_requests"] == 2048
    assert llama("sglang", chunked_prefill_size=2048).to_dict()["budget"]["fraction"] == 0.831


def test_render_is_the_seed000_ledger():
    text = render_ledger(llama(estimates=NO_ESTIMATES, prompt_tokens=512, output_tokens=256))
    for word in ("capacity ledger: vllm 0.33.0", "model", "budget", "capacity", "request", "admission"):
        assert word in text
    assert "58,336" in text and "7.12x" in text and "7.12 GiB" in text and "3,646" in text
    sg = render_ledger(llama("sglang", prompt_tokens=512, output_tokens=256))
    assert "0.704" in sg and "15,879" in sg and "max_req_input_len" in sg


def test_override_without_gpu_memory_like_the_emulator():
    led = build_ledger(LedgerInputs(engine="vllm", model="meta-llama/Llama-3.1-8B", max_model_len=8192,
                                    num_gpu_blocks_override=2048))
    assert (led.capacity.kv_tokens, led.capacity.num_blocks) == (32_768, 2048)
    assert led.budget.total_bytes is None
    sg = build_ledger(LedgerInputs(engine="sglang", model="meta-llama/Llama-3.1-8B", context_length=8192,
                                   max_total_tokens="20k"))
    assert sg.capacity.kv_tokens == 20_000


def test_auto_max_model_len_fits_the_pool():
    led = llama(max_model_len="auto", estimates=NO_ESTIMATES)
    assert led.capacity.max_model_len == 58_320


def test_deepseek_v3_on_8_h200():
    led = build_ledger(LedgerInputs(engine="vllm", model="deepseek-ai/DeepSeek-V3", gpu_memory_bytes=141 * GIB,
                                    tp=8, max_model_len=32768))
    d = led.to_dict()
    assert d["model"]["kv_bytes_per_token"] == 70272 and d["capacity"]["block_size"] == 64
    assert d["capacity"]["bytes_per_block"] == 70272 * 64
    assert 75 * GIB < d["model"]["weight_bytes"] < 85 * GIB
    assert (d["capacity"]["max_running"], d["capacity"]["token_budget"]) == (1024, 8192)


def test_glm53_bytes_per_token():
    led = build_ledger(LedgerInputs(engine="vllm", model="zai-org/GLM-5.3", gpu_memory_bytes=141 * GIB, tp=8,
                                    kv_cache_dtype="fp8_ds_mla", max_model_len=131072))
    m = led.to_dict()["model"]
    assert (m["kv_bytes_per_token_main"], m["kv_bytes_per_token_indexer"], m["kv_bytes_per_token"]) == \
        (51_168, 2_772, 53_940)
    assert led.capacity.bytes_per_block == 3_452_160


@pytest.mark.parametrize("change,match", [
    (dict(model="acme/Nope-1B"), "unknown model"),
    (dict(model="/nonexistent/config.json"), "no model config"),
    (dict(engine="trt"), "engine"),
    (dict(gpu_memory_bytes=16 * GIB), "No available memory"),
    (dict(prompt_tokens=8000, output_tokens=256), "beyond max_model_len"),
    (dict(prompt_tokens=512), "both prompt_tokens and output_tokens"),
    (dict(max_model_len=10**6), "max_position_embeddings"),
    (dict(max_num_seqs=512, max_num_batched_tokens=256), "max_num_batched_tokens"),
    (dict(tp=0), "tp"),
])
def test_impossible_settings_are_config_errors(change, match):
    with pytest.raises(ConfigError, match=match) as err:
        llama(**change)
    assert "\n" not in str(err.value)


def test_sglang_length_limit():
    with pytest.raises(ConfigError, match="length limit"):
        llama("sglang", prompt_tokens=8000, output_tokens=191)
    assert llama("sglang", prompt_tokens=8000, output_tokens=190).request.length_limit == 8190


def test_unreadable_config_path(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        build_ledger(LedgerInputs(engine="vllm", model="config.json", base_dir=str(tmp_path)))


# ---- admission section: needs THEORY-SCHED's kvprobe.theory.admission / schedsim


def test_admission_section_present():
    pytest.importorskip("kvprobe.theory.admission")
    pytest.importorskip("kvprobe.theory.schedsim")
    led = llama(estimates=NO_ESTIMATES, prompt_tokens=512, output_tokens=256, users=100)
    a = led.to_dict()["admission"]
    assert {"policy", "limit", "no_preemption_limit", "binding", "usage_at_limit", "running", "waiting"} <= set(a)
    assert a["policy"] == "vllm-0.33"
    assert led.scheduler_config.num_gpu_blocks == 3646
    assert "binding limit: " + a["binding"] in render_ledger(led)
    sg = llama("sglang", prompt_tokens=512, output_tokens=256)
    assert sg.to_dict()["admission"]["policy"].startswith("sglang")
    assert sg.scheduler_config.max_total_num_tokens == 15_879


def test_admission_absent_without_request_shape():
    led = llama()
    assert led.admission is None and led.to_dict()["admission"] is None
    assert "admission: not predicted" in render_ledger(led)


@pytest.mark.parametrize("engine,version,rule", [
    ("vllm", "0.11.0", "first chunk fits, before 0.19"), ("vllm", "0.33.0", "whole prompt must fit from 0.19"),
    ("sglang", "0.5.21", "new_token_ratio, up to 0.5.21"), ("sglang", "0.5.23", "in full (ratio 1.0) from 0.5.22")])
def test_the_ledger_names_the_release_rule_it_applied(engine, version, rule):
    led = build_ledger(LedgerInputs(engine=engine, model="meta-llama/Llama-3.1-8B", engine_version=version,
                                    gpu_memory_bytes=80 * GIB, prompt_tokens=512, output_tokens=128))
    row = next(line for line in render_ledger(led).splitlines() if line.startswith("policy "))
    assert "the release rule: " in row and rule in row
