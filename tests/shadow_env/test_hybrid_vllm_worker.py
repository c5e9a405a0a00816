"""The vLLM shadow worker registers a hybrid model's layer specs, and vLLM's own EngineCore plans the
pool from them exactly as kvprobe's ledger does.

For each case the shadow target's real command line (`kvprobe.targets.shadow.launch.command`) goes through
vLLM 0.33.0's CLI parser, config resolution and CPU platform; EngineCore.__init__ builds the
model-less worker, takes its KV cache spec (`vllm_kvspec.hybrid_kv_cache_spec`, the specs of
`theory.vllm_kv.vllm_layer_specs` as vLLM objects), groups the layers, plans the pool and computes
the capacity line (`tests/shadow/vllm_planner.py`, in the engine environment). No server, no traffic: a
few seconds per case after vLLM's imports.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvprobe.errors import ConfigError
from kvprobe.probe.run import predict
from kvprobe.spec.expectation import load_expectations
from kvprobe.theory.model.geometry import load_model_config
from tests.engine_envs import engine_env
from tests.vllm_plans import plan_all, serve_case

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
GPT_OSS = "openai/gpt-oss-20b"
QWEN3_NEXT = "Qwen/Qwen3-Next-80B-A3B-Instruct"
SMALL = {"num-gpu-blocks-override": 400, "max-model-len": 4096, "max-num-seqs": 8, "max-num-batched-tokens": 512}
CASES = {  # name -> (model, the expectation's keys)
    "gpt-oss-20b, 400 blocks": (GPT_OSS, {"flags": SMALL}),
    "gpt-oss-20b, sync, no prefix caching": (GPT_OSS, {"flags": {**SMALL, "async-scheduling": False,
                                                                "enable-prefix-caching": False}}),
    "gpt-oss-20b on an 80 GiB GPU": (GPT_OSS, {"flags": {"max-model-len": 8192}, "hardware": {"gpu_memory": "80GiB"}}),
    "Mistral 7B v0.1 (a window on every layer)": ("mistralai/Mistral-7B-v0.1", {"flags": SMALL}),
    # Gated DeltaNet layers: three Mamba groups beside the full one, the attention block enlarged to
    # hold a state (544 tokens; 576 in "align" mode with FlashInfer's 64-token checkpoints)
    "Qwen3-Next, prefix caching off (Mamba none)": (QWEN3_NEXT, {"flags": {**SMALL, "enable-prefix-caching": False}}),
    "Qwen3-Next, prefix caching on (Mamba align)": (QWEN3_NEXT, {"flags": SMALL}),
    # an A100 runs Triton/FLA's GDN prefill, which takes no checkpoint block: 544-token blocks in "align" too
    "Qwen3-Next, prefix caching on, an A100": (QWEN3_NEXT, {"flags": SMALL, "hardware": {"gpu": "A100-80GB"}}),
}
REFUSED = {"gpt-oss-20b, 300 blocks": (GPT_OSS, {"flags": {**SMALL, "num-gpu-blocks-override": 300}})}


@pytest.fixture(scope="module")
def vllm_env(pytestconfig):
    return engine_env("vllm", "0.33.0", pytestconfig)


def _write(tmp_path: Path, name: str, model: str, keys: dict) -> Path:
    doc = {"name": "".join(c if c.isalnum() or c in "._" else "-" for c in name), "engine": "vllm", "version": "0.33.0",
           "model": model,
           "target": {"launch": "shadow"},
           "profile": {"request": {"prompt_tokens": 1000, "output_tokens": 200},
                       "ramp": {"strategy": "explicit", "levels": [1]}, "hold": {"seconds": 1}}, **keys}
    path = tmp_path / f"{doc['name']}.yaml"
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def planned(vllm_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid-worker")
    cases = {**CASES, **REFUSED}
    # a layer kind transformers accepts and kvprobe does not model (ViT-style windows): the worker
    # says so, naming the key (an unknown name is refused by transformers' own validator first)
    cfg, _ = load_model_config("meta-llama/Llama-3.1-8B")
    (tmp / "mystery.json").write_text(json.dumps({**cfg,
                                                  "layer_types": ["window_attention"] * cfg["num_hidden_layers"]}))
    exps = {n: load_expectations(_write(tmp, n, m, k))[0] for n, (m, k) in cases.items()}
    mystery = load_expectations(_write(tmp, "mystery", "./mystery.json", {"flags": SMALL,
                                                                          "served_model_name": "mystery"}))[0]
    plans = plan_all(vllm_env, [serve_case(e) for e in [*exps.values(), mystery]])
    return {n: (exps[n], p) for n, p in zip(cases, plans, strict=False)} | {"mystery": (mystery, plans[-1])}


@pytest.mark.parametrize("name", list(CASES))
def test_vllms_planner_on_the_workers_hybrid_specs_is_the_ledgers_pool(planned, name):
    exp, plan = planned[name]
    assert "error" not in plan, plan["error"]
    led = predict(exp)
    cap = led.to_dict()["capacity"]
    # the groups as vLLM formed them from the worker's specs: spec, layers, window or chunk, block
    # and page — the ledger's plan (theory.vllm_kv), group for group
    specs = {s.name: s for s in led.budget.plan.specs}
    ours = [(g.spec, len(g.layers), specs[g.layers[0]].sliding_window or specs[g.layers[0]].attention_chunk_size,
             g.block_size, g.page_size_bytes) for g in led.budget.plan.groups]
    got = [(g["spec"], g["layers"], g["window"], g["block_size"], g["page_size_bytes"]) for g in plan["group_detail"]]
    assert got == ours
    assert (plan["num_blocks"], plan["kv_tokens"]) == (cap["num_blocks"], cap["kv_tokens"])
    assert plan["max_concurrency"] == pytest.approx(cap["max_concurrency_at_max_model_len"], rel=1e-12)
    assert plan["max_model_len"] == cap["max_model_len"]


def test_the_declared_card_reaches_the_workers_gdn_specs(planned):
    """The worker is told the card (WorkerSettings.gpu_capability): FlashInfer's 64-token grid on the default
    Hopper, none on an A100, as vLLM's planner then groups them."""
    blocks = {name: {g["block_size"] for g in planned[name][1]["group_detail"]}
              for name in ("Qwen3-Next, prefix caching on (Mamba align)", "Qwen3-Next, prefix caching on, an A100")}
    assert list(blocks.values()) == [{576}, {544}]


def test_a_pool_too_small_is_refused_by_vllm_in_the_ledgers_words(planned):
    exp, plan = planned["gpt-oss-20b, 300 blocks"]
    with pytest.raises(ConfigError) as refusal:
        predict(exp)
    assert plan["error"] == f"ValueError: {refusal.value}"
    assert "the estimated maximum model length is 3616" in plan["error"]


def test_a_layer_kind_kvprobe_does_not_know_is_one_clear_error_naming_the_key(planned):
    _, plan = planned["mystery"]
    assert "UnsupportedModelError: kvprobe's shadow worker cannot describe this model's KV cache" in plan["error"]
    assert "layer_types" in plan["error"] and "window_attention" in plan["error"]
