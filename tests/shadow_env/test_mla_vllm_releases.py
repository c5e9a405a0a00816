"""MLA on the vLLM releases before 0.33.0: the shadow worker builds DeepSeek-V3's latent-cache spec with the
fields each release's own MLA layer passes (`compat.mla_fields`), and that release's EngineCore plans the pool
from it exactly as kvprobe's ledger does (`tests/shadow/vllm_planner.py`, as tests/shadow/test_vllm_planner.py
runs it on 0.33.0). No server, no traffic: one vLLM import per release, a few seconds per case after it.

Releases: 0.18.1 (a suite environment, installed when missing); with KVPROBE_RELEASES=installed (`make
matrix`) also every other release but 0.33.0 built on this machine (0.34.0 included) (`recipes.installed`, about half a
minute each): `make test` installs and runs nothing beyond its pair. A DSA indexer is refused
through 0.29.0, naming the release and the kind; from 0.30.0 (the indexer cache's SparseCacheRole) it is
described, and that release's planner plans the ledger's pool for it too. Window layers (gpt-oss-20b's sliding
and full groups) are described on every release, with the value-head field each one's SlidingWindowSpec has
(`compat.attention_fields`), and planned as the ledger plans them under that release's window rules
(theory/vllm/releases.py: one batch in flight before 0.26.0, the size line of groups x blocks before 0.20.1).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvprobe.probe.run import predict
from kvprobe.releases import version_tuple
from kvprobe.spec.expectation import load_expectations
from kvprobe.targets.shadow import recipes
from tests.engine_envs import engine_env
from tests.shadow.conftest import say  # noqa: F401  (fixture)
from tests.vllm_plans import plan_all, serve_case

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

SUITE_RELEASE = "0.18.1"
NEWEST = (0, 33, 0)  # the worker's own release: tests/shadow/test_vllm_planner.py
ALL_INSTALLED = os.environ.get("KVPROBE_RELEASES") == "installed"  # make matrix
OTHERS = [v for v in recipes.installed("vllm") if version_tuple(v) != NEWEST] if ALL_INSTALLED else []
RELEASES = sorted({SUITE_RELEASE, *OTHERS}, key=version_tuple)
DEEPSEEK_V3 = "deepseek-ai/DeepSeek-V3"
CASES = {  # name -> (model, the expectation's keys)
    "deepseek-v3, 10 GiB": (DEEPSEEK_V3, {"flags": {"kv-cache-memory-bytes": "10GiB", "max-model-len": 8192}}),
    "deepseek-v3, 1000 blocks": (DEEPSEEK_V3, {"flags": {"num-gpu-blocks-override": 1000, "max-model-len": 4096}}),
}
# DeepSeek-V3 with V3.2's indexer keys (deepseek_v2.py builds an indexer for `index_topk`): a model type every
# release's transformers reads (GLM-5.3's glm_moe_dsa is refused by 0.18.1's before the worker runs)
DSA = ("./dsa.json", {"flags": {"kv-cache-memory-bytes": "10GiB", "max-model-len": 8192},
                      "served_model_name": "dsa/DeepSeek-V3"})
DSA_KEYS = {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}
# from 0.30.0 (the DSA planner checks): the dsa.json model above, and GLM-5.3's ds_mla cache as 0.33.0's
# tests/shadow/test_vllm_planner.py plans it
DSA_CASES = {"dsa": None,
             "glm-5.3 fp8_ds_mla": ("zai-org/GLM-5.3", {"flags": {"kv-cache-memory-bytes": "10GiB",
                                                                  "max-model-len": 8192,
                                                                  "kv-cache-dtype": "fp8_ds_mla"}})}


def _write(tmp_path: Path, version: str, name: str, model: str, keys: dict) -> Path:
    slug = "".join(c if c.isalnum() or c in "._" else "-" for c in f"{name}-{version}")
    doc = {"name": slug, "engine": "vllm", "version": version, "model": model, "target": {"launch": "shadow"},
           "profile": {"request": {"prompt_tokens": 128, "output_tokens": 32},
                       "ramp": {"strategy": "explicit", "levels": [1]}, "hold": {"seconds": 1}}, **keys}
    path = tmp_path / f"{slug}.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


@pytest.fixture(scope="module", params=RELEASES)
def planned(request, tmp_path_factory):
    """(release, {name: (expectation, plan)}): every case of one release from one planner run."""
    version = request.param
    env = engine_env("vllm", version, request.config)
    tmp = tmp_path_factory.mktemp(f"mla-{version}")
    config = json.loads((REPO / "kvprobe/theory/model/configs/deepseek-v3.json").read_text())
    (tmp / "dsa.json").write_text(json.dumps({**config, **DSA_KEYS}))
    cases = {**CASES, "dsa": DSA, WINDOW_CASE: WINDOW}
    if version_tuple(version) >= DSA_FROM:  # glm_moe_dsa: older releases' transformers refuse the model type
        cases["glm-5.3 fp8_ds_mla"] = DSA_CASES["glm-5.3 fp8_ds_mla"]
    exps = {n: load_expectations(_write(tmp, version, n, m, k))[0] for n, (m, k) in cases.items()}
    plans = plan_all(env, [serve_case(e) for e in exps.values()])
    return version, {n: (exps[n], p) for n, p in zip(cases, plans, strict=True)}


def plan_and_ledger(planned, name: str) -> tuple[str, dict, dict]:
    """(release, what its planner planned for case `name`, the ledger's capacity for it)."""
    version, by_name = planned
    exp, plan = by_name[name]
    assert "error" not in plan, (version, plan["error"])
    return version, plan, predict(exp).to_dict()["capacity"]


def assert_the_ledgers_pool(version: str, plan: dict, ledger: dict) -> None:
    assert plan["num_blocks"] == ledger["num_blocks"], version
    assert plan["kv_tokens"] == ledger["kv_tokens"], version
    assert plan["max_concurrency"] == pytest.approx(ledger["max_concurrency_at_max_model_len"], rel=1e-9), version


@pytest.mark.parametrize("name", list(CASES))
def test_each_releases_planner_on_the_workers_mla_specs_is_the_ledgers_pool(planned, name, say):  # noqa: F811
    version, plan, ledger = plan_and_ledger(planned, name)
    say(f"\nvLLM {version} {name}: planned {plan['num_blocks']} blocks of {plan['block_size']} "
        f"({plan['group_detail']}), {plan['kv_tokens']} tokens; ledger {ledger['num_blocks']} blocks of "
        f"{ledger['block_size']}, {ledger['kv_tokens']} tokens")
    assert plan["groups"] == ["MLAAttentionSpec"] and plan["block_size"] == 64, (version, plan)
    assert_the_ledgers_pool(version, plan, ledger)
    # what a GPU runs with, not the CPU platform's MLA settings (chunked prefill and prefix caching off)
    assert plan["chunked_prefill"] and plan["prefix_caching"], (version, plan)


def test_the_page_is_the_latent_cache_per_layer(planned):
    """576 bf16 values a token (kv_lora_rank 512 + RoPE 64) in every one of the 61 layers. (An fp8 cache is not
    planned here: 0.18.1's CPU platform refuses fp8 with chunked prefill before the worker runs, platforms/cpu.py
    L180-184, which a GPU does not.)"""
    version, by_name = planned
    (group,) = by_name["deepseek-v3, 10 GiB"][1]["group_detail"]
    assert group["layers"] == 61 and group["page_size_bytes"] == 64 * 576 * 2, (version, group)


DSA_FROM = (0, 30, 0)  # compat.NO_INDEXER_ROLE_THROUGH: the indexer cache's SparseCacheRole
# expectations/diff/vllm-hybrid-window-shadow.yaml's pool and budget: on 0.18.1 the engine logs 3,200 tokens and
# 1.35x (400 / (256 + 41 window blocks)), on 0.33.0 4,979 and 1.22x (400 / (256 + 73))
WINDOW_CASE = "gpt-oss-20b, 400 blocks"
WINDOW = ("openai/gpt-oss-20b", {"flags": {"num-gpu-blocks-override": 400, "max-model-len": 4096, "block-size": 16,
                                          "max-num-seqs": 16, "max-num-batched-tokens": 512}})


def test_window_layers_plan_the_ledgers_pool_under_the_releases_rules(planned, say):  # noqa: F811
    version, plan, ledger = plan_and_ledger(planned, WINDOW_CASE)
    say(f"\nvLLM {version} {WINDOW_CASE}: planned {plan['groups']}, {plan['kv_tokens']} tokens, "
        f"{plan['max_concurrency']:.4f}x; ledger {ledger['kv_tokens']} tokens, "
        f"{ledger['max_concurrency_at_max_model_len']:.4f}x")
    assert sorted(plan["groups"]) == ["FullAttentionSpec", "SlidingWindowSpec"], (version, plan)
    assert_the_ledgers_pool(version, plan, ledger)
    if version == SUITE_RELEASE:
        assert (plan["kv_tokens"], round(plan["max_concurrency"], 2)) == (3200, 1.35)


def test_a_dsa_indexer_is_refused_before_0_30_naming_the_release_and_the_kind(planned):
    version, by_name = planned
    error = by_name["dsa"][1].get("error", "")
    if version_tuple(version) >= DSA_FROM:
        assert not error and by_name["dsa"][1]["groups"] == ["MLAAttentionSpec"], (version, by_name["dsa"][1])
    else:
        assert f"MLA and Mamba models on vLLM {version}; this model has a DSA indexer" in error, (version, error)


@pytest.mark.parametrize("name", list(DSA_CASES))
def test_from_0_30_the_dsa_indexer_plans_the_ledgers_pool(planned, name, say):  # noqa: F811
    if version_tuple(planned[0]) < DSA_FROM:
        pytest.skip(f"vLLM {planned[0]}: DSA indexers are refused (the test above)")
    version, plan, ledger = plan_and_ledger(planned, name)
    say(f"\nvLLM {version} {name}: planned {plan['num_blocks']} blocks ({plan['group_detail']}), {plan['kv_tokens']} "
        f"tokens; ledger {ledger['num_blocks']} blocks of {ledger['block_size']}, {ledger['kv_tokens']} tokens")
    assert (plan["num_blocks"], plan["kv_tokens"]) == (ledger["num_blocks"], ledger["kv_tokens"]), version
