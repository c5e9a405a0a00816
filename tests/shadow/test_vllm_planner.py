"""vLLM's own KV planner, fed by kvprobe's worker, against kvprobe's ledger: two computations of one pool.

For each sizing, the shadow target's real command line (`kvprobe.targets.shadow.launch.command`) goes
through vLLM 0.33.0's CLI parser, config resolution and CPU platform, then EngineCore.__init__
builds the worker, asks it for its KV cache spec and bytes, groups the layers, plans the pool,
applies `--num-gpu-blocks-override` and computes the capacity line (`tests/shadow/vllm_planner.py`,
run in the engine environment). The ledger's numbers must be the same to the block.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvprobe.errors import ConfigError
from kvprobe.probe.run import predict
from kvprobe.spec.expectation import load_expectations
from tests.vllm_plans import plan_all, serve_case

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent

# name -> the expectation's keys beside engine/version/target/profile
CASES = {
    "override": {"flags": {"num-gpu-blocks-override": 1000, "block-size": 16, "max-model-len": 4096}},
    "kv-bytes": {"flags": {"kv-cache-memory-bytes": "4GiB", "max-model-len": 4096}},
    "gpu-24GiB-util-0.9": {"flags": {"gpu-memory-utilization": 0.9, "max-model-len": 4096},
                           "hardware": {"gpu_memory": "24GiB"}},
    "gpu-24GiB-util-0.7": {"flags": {"gpu-memory-utilization": 0.7, "max-model-len": 2048},
                           "hardware": {"gpu_memory": "24GiB"}},
    "gpu-80GiB-default": {"flags": {"max-model-len": 8192}, "hardware": {"gpu_memory": "80GiB"}},
    "gpu-80GiB-estimates": {"flags": {"max-model-len": 8192}, "hardware": {"gpu_memory": "80GiB"},
                            "estimates": {"activation_bytes": "3GiB", "cudagraph_bytes": "1GiB"}},
    "qwen-gqa": {"model": "Qwen/Qwen2.5-7B", "flags": {"gpu-memory-utilization": 0.95, "max-model-len": 4096},
                 "hardware": {"gpu_memory": "24GiB"}},
    "deepseek-v3-mla": {"model": "deepseek-ai/DeepSeek-V3",
                        "flags": {"kv-cache-memory-bytes": "10GiB", "max-model-len": 8192}},
    "glm-5.3-fp8_ds_mla": {"model": "zai-org/GLM-5.3", "flags": {"kv-cache-memory-bytes": "10GiB",
                                                                 "max-model-len": 8192,
                                                                 "kv-cache-dtype": "fp8_ds_mla"}},
}
# The ledger refuses these itself; vLLM must refuse them too, with the same estimate.
REFUSED = {
    "gpu-24GiB-util-0.685": {"flags": {"gpu-memory-utilization": 0.685, "max-model-len": 2048},
                             "hardware": {"gpu_memory": "24GiB"}},
    "override-too-small": {"flags": {"num-gpu-blocks-override": 100, "block-size": 16, "max-model-len": 4096}},
}


def _write(tmp_path: Path, name: str, keys: dict) -> Path:
    doc = {"name": name, "engine": "vllm", "version": "0.33.0", "model": "meta-llama/Llama-3.1-8B",
           "target": {"launch": "shadow"},
           "profile": {"request": {"prompt_tokens": 128, "output_tokens": 32},
                       "ramp": {"strategy": "explicit", "levels": [1]}, "hold": {"seconds": 1}}, **keys}
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


# Planned in the same vLLM process as the sizings (one import of vLLM for the module): the sync
# scheduler's command line, and a model whose layer kind the worker cannot describe (a layer kind
# transformers accepts — its validator refuses made-up names before the worker runs — and kvprobe
# does not model), planned last.
SYNC = {"flags": {"num-gpu-blocks-override": 1000, "max-model-len": 4096, "async-scheduling": False}}
ODD = {"model": "./odd.json", "served_model_name": "odd/Llama",
       "flags": {"num-gpu-blocks-override": 1000, "max-model-len": 4096}}


def _odd_config(folder: Path) -> None:
    config = json.loads((Path(__file__).parents[2] / "kvprobe/theory/model/configs/llama-3.1-8b.json").read_text())
    config["layer_types"] = ["window_attention"] * config["num_hidden_layers"]
    (folder / "odd.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def planned(vllm_env, tmp_path_factory):
    """Every case's plan (or refusal) from one planner run: {name: (expectation, plan)}."""
    tmp = tmp_path_factory.mktemp("planner")
    _odd_config(tmp)
    keys = {**CASES, "sync": SYNC, **REFUSED, "odd": ODD}
    exps = [load_expectations(_write(tmp, n, k))[0] for n, k in keys.items()]
    plans = plan_all(vllm_env, [serve_case(e) for e in exps])
    return dict(zip(keys, zip(exps, plans, strict=True), strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_planner_builds_the_ledgers_pool(planned, name, say):
    exp, plan = planned[name]
    ledger = predict(exp).to_dict()["capacity"]
    say(f"\n{name}: vLLM planned {plan.get('num_blocks')} blocks of {plan.get('block_size')}, {plan.get('kv_tokens')} "
        f"tokens, {plan.get('max_concurrency')}x ({plan.get('groups')}, {plan.get('scheduler')}); ledger "
        f"{ledger['num_blocks']} blocks of {ledger['block_size']}, {ledger['kv_tokens']} tokens, "
        f"{ledger['max_concurrency_at_max_model_len']}x")
    assert "error" not in plan, plan["error"]
    assert plan["num_blocks"] == ledger["num_blocks"]
    assert plan["block_size"] == ledger["block_size"]
    assert plan["kv_tokens"] == ledger["kv_tokens"]
    assert plan["max_concurrency"] == pytest.approx(ledger["max_concurrency_at_max_model_len"], rel=1e-9)
    # what a GPU would run with, not what vLLM's CPU platform picks (128 / 2048, chunked prefill
    # and prefix caching off for MLA)
    assert plan["max_num_seqs"] == ledger["max_running"]
    assert plan["max_num_batched_tokens"] == ledger["token_budget"]
    assert plan["chunked_prefill"] and plan["prefix_caching"] and plan["scheduler"] == "AsyncScheduler"
    assert plan["async_scheduling"] is True


def test_no_async_scheduling_keeps_vllms_sync_scheduler(planned):
    _, plan = planned["sync"]
    assert plan["scheduler"] == "Scheduler" and plan["num_blocks"] == 1000, plan


def test_mla_models_plan_one_mla_group_of_64_token_blocks(planned):
    for name in ("deepseek-v3-mla", "glm-5.3-fp8_ds_mla"):
        _, plan = planned[name]
        assert plan["groups"] == ["MLAAttentionSpec"] and plan["block_size"] == 64, plan


@pytest.mark.parametrize("name", list(REFUSED))
def test_vllm_refuses_where_the_ledger_refuses(planned, name, say):
    exp, plan = planned[name]
    with pytest.raises(ConfigError) as ledger_refusal:
        predict(exp)
    say(f"\n{name}: vLLM: {plan.get('error')}\n{name}: ledger: {ledger_refusal.value}")
    assert "error" in plan, plan
    # word for word: the GiB figures and the estimate of the longest sequence that would fit
    assert plan["error"] == f"ValueError: {ledger_refusal.value}"


def test_a_layer_kind_the_worker_cannot_describe_is_one_clear_error(planned):
    _, plan = planned["odd"]
    error = plan.get("error", "")
    assert "cannot describe this model's KV cache" in error and "layer_types" in error, plan
