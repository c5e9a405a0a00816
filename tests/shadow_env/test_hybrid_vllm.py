"""kvprobe's hybrid KV plan against vLLM 0.33.0's own code, with no server and no GPU.

Three things are checked in the vLLM environment:
* the layer kinds: vLLM's config reading (`get_config`, i.e. transformers' config classes) and
  `vllm serve`'s config resolution give the layers kvprobe's `layer_kinds` says;
* the spec choices: FlashAttention's block sizes, the window layer's block, the Gated DeltaNet
  state and the hybrid block alignment, from vLLM's own functions;
* the plan: kvprobe's layer specs, turned into vLLM's `KVCacheSpec` objects
  (`kvprobe.targets.shadow.vllm.kvplan`) and planned by `get_kv_cache_configs`, give the groups, block
  count, capacity tokens, max concurrency and startup errors kvprobe computes.
"""

from __future__ import annotations

import dataclasses

import pytest
from hybrid_engines import HERE, model_folder, run_json

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import geometry_from_config, load_model_config
from kvprobe.theory.model.layers import CHUNKED, FULL, LINEAR, SLIDING
from kvprobe.theory.vllm.hybrid.kv_cache_planning import vllm_kv_plan
from kvprobe.theory.vllm.hybrid.kv_cache_spec import (
    GDN_PREFILL_BACKENDS,
    VllmOptions,
    hybrid_block_size,
    hybrid_kv_cache_manager,
    resolve_gdn_prefill_backend,
    vllm_layer_specs,
)
from tests.engine_envs import engine_env

pytestmark = pytest.mark.slow
GIB = 2**30
HYBRID = ["openai/gpt-oss-20b", "openai/gpt-oss-120b", "google/gemma-3-27b-it",
          "meta-llama/Llama-4-Scout-17B-16E-Instruct", "Qwen/Qwen3-Next-80B-A3B-Instruct",
          "mistralai/Mistral-7B-v0.1"]
_KIND = {"full_attention": FULL, "sliding_attention": SLIDING, "chunked_attention": CHUNKED,
         "linear_attention": LINEAR}


@pytest.fixture(scope="module")
def vllm_env(pytestconfig):
    return engine_env("vllm", "0.33.0", pytestconfig)


def geom(name):
    cfg, _ = load_model_config(name)
    return cfg, geometry_from_config(cfg, name)


def _gdn_cases():
    """Qwen3-Next's Gated DeltaNet layer under each option: (options, GDN checkpoint alignment the
    layers register), and the request for vLLM's own spec functions."""
    _, g = geom("Qwen/Qwen3-Next-80B-A3B-Instruct")
    lin = g.layers.linear
    base = {"linear_num_key_heads": lin.num_k_heads, "linear_num_value_heads": lin.num_v_heads,
            "linear_key_head_dim": lin.head_k_dim, "linear_value_head_dim": lin.head_v_dim,
            "linear_conv_kernel_dim": lin.conv_kernel, "num_key_value_heads": g.num_kv_heads,
            "head_dim": g.head_dim, "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto"}
    cases = [
        (VllmOptions(), 64), (VllmOptions(gdn_prefill_backend="triton"), None),
        (VllmOptions(tp=2), 64), (VllmOptions(block_size=1024), 64),
        (VllmOptions(mamba_ssm_cache_dtype="float32", gdn_prefill_backend="triton"), None)]
    req = [{**base, "tp": o.tp, "block_size": o.block_size, "mamba_cache_mode": o.mamba_cache_mode,
            "mamba_ssm_cache_dtype": o.mamba_ssm_cache_dtype, "checkpoint_alignment": a} for o, a in cases]
    return cases, req


@pytest.fixture(scope="module")
def facts(vllm_env, tmp_path_factory):
    """One run of vllm_hybrid_facts.py (one import of vLLM) for the layer kinds of every HYBRID
    model's folder and the spec choices of every GDN case: (folders, facts)."""
    tmp = tmp_path_factory.mktemp("hybrid-vllm")
    folders = {m: model_folder(tmp, m, load_model_config(m)[0]) for m in HYBRID}
    answer = run_json(vllm_env, [str(HERE / "vllm_hybrid_facts.py")],
                      {"models": list(folders.values()), "gdn": _gdn_cases()[1], "gdn_backends": GDN_BACKENDS})
    return folders, answer


def test_vllm_reads_the_layer_kinds_kvprobe_does(facts):
    folders, facts = facts
    for name, folder in folders.items():
        got = facts["configs"][folder]
        ours = geom(name)[1].layers
        if got["model_type"] == "llama4_text":
            # models/llama4.py L184-185, L251-252: RoPE layers (no_rope_layers[i] != 0) are chunked
            assert ours.kinds == tuple(CHUNKED if r else FULL for r in got["no_rope_layers"])
            assert ours.kinds == tuple(_KIND[t] for t in got["layer_types"])
            assert ours.attention_chunk_size == got["attention_chunk_size"] == 8192
        elif got["layer_types"] is None:  # Mistral: no layer_types, the model-level window on all
            assert got["model_type"] == "mistral" and ours.kinds == (SLIDING,) * 32
            assert ours.sliding_window == got["sliding_window"] == 4096
        else:
            assert ours.kinds == tuple(_KIND[t] for t in got["layer_types"]), name
            assert ours.sliding_window == (got["sliding_window"] if SLIDING in ours.kinds else None)
        if ours.linear is not None:
            g = ours.linear
            assert (g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim, g.conv_kernel) == tuple(
                got[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                 "linear_value_head_dim", "linear_conv_kernel_dim"))


RESOLUTION = [  # (name, VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE, hybrid manager, window)
    ("mistralai/Mistral-7B-v0.1", "1", True, 4096),  # every layer windowed through CacheConfig
    # Llama 4's text model as a text-only folder: the multimodal class needs torchvision to be
    # inspected here ("Model architectures ['Llama4ForConditionalGeneration'] failed to be inspected")
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "1", True, None),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "0", False, None),
]


@pytest.fixture(scope="module")
def resolved(vllm_env, tmp_path_factory):
    """`vllm serve`'s config resolution of each RESOLUTION case (a folder of its own, the variable
    set for it), one after another in one run of vllm_hybrid_facts.py: {case: facts}."""
    engines = []
    for i, (name, allow, _, _) in enumerate(RESOLUTION):
        cfg, _ = geom(name)
        if "text_config" in cfg:
            cfg = {**cfg["text_config"], "architectures": ["Llama4ForCausalLM"], "tie_word_embeddings": False}
        folder = model_folder(tmp_path_factory.mktemp(f"resolution{i}"), name, cfg)
        engines.append({"folder": folder, "env": {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": allow}})
    answers = run_json(vllm_env, [str(HERE / "vllm_hybrid_facts.py")], {"engines": engines})
    return dict(zip(RESOLUTION, answers, strict=True))


@pytest.mark.parametrize("name,allow,hma,window", RESOLUTION)
def test_vllm_serve_config_resolution(resolved, name, allow, hma, window):
    _, g = geom(name)
    facts = resolved[(name, allow, hma, window)]
    ours, _ = hybrid_kv_cache_manager(g, VllmOptions(allow_chunked_local_attn_with_hybrid_kv_cache=allow == "1"))
    assert facts["hybrid_kv_cache_manager"] == ours == hma
    assert facts["cache_sliding_window"] == window
    assert facts["attention_chunk_size"] == g.layers.attention_chunk_size


def test_spec_choices_come_from_vllms_own_functions(facts):
    _, facts = facts
    _, g = geom("Qwen/Qwen3-Next-80B-A3B-Instruct")
    cases, _ = _gdn_cases()
    assert facts["backend"] == {"flash_attn_block_sizes": ["MultipleOf(16)"], "sliding_block_for_16": 16}
    for (opts, _), got in zip(cases, facts["gdn"], strict=True):
        state = next(s for s in vllm_layer_specs(g, opts) if s.spec == "MambaSpec")
        assert [list(s) for s in state.shapes] == got["shapes"] and list(state.dtypes) == got["dtypes"]
        block, padded = hybrid_block_size(g, opts)
        assert (block, padded) == (got["block_size"], got["mamba_page_size_padded"]), opts
        assert state.block_size == got["mamba_block_size"]


# The cards kvprobe names (spec/gpus.py) and the Blackwell families, the two head sizes that part them, and each
# value of --gdn-prefill-backend: what 0.33.0's _resolve_gdn_prefill_backend picks (or refuses) on each.
GDN_BACKENDS = [{"capability": cap, "head_k_dim": k, "requested": asked}
                for cap in ([8, 0], [8, 6], [8, 9], [9, 0], [10, 0], [10, 3], [12, 0], [12, 1])
                for k in (128, 64) for asked in (None, *GDN_PREFILL_BACKENDS)]


def test_the_gdn_prefill_kernel_is_vllms_choice_on_each_card(facts):
    _, facts = facts
    checkpoints = 0
    for req, got in zip(GDN_BACKENDS, facts["gdn_backends"], strict=True):
        try:
            ours = {"backend": resolve_gdn_prefill_backend(req["requested"], "{}.{}".format(*req["capability"]),
                                                           req["head_k_dim"])}
        except ConfigError as err:
            ours = {"error": str(err).removeprefix(f"{err.key}: ")}
        assert ours == got, req
        checkpoints += ours.get("backend") == "flashinfer"
    assert checkpoints == 12  # auto or flashinfer: on 9.0 at either head, on 10.x and 12.x at 128 only


def _cases():
    """(model, max_model_len, budget, options, auto_fit): defaults, the knobs that move the plan,
    overrides, auto-fit and budgets too small for one request."""
    out = []
    for name in HYBRID:
        for mml in (8192, 131072):
            out.append((name, mml, {"available_bytes": 40 * GIB}, VllmOptions(), False))
        out.append((name, 32768, {"available_bytes": 24 * GIB},
                    VllmOptions(max_num_batched_tokens=8192, async_scheduling=False), False))
        out.append((name, 32768, {"num_gpu_blocks_override": 3000}, VllmOptions(hybrid_kv_cache_manager=False), False))
        out.append((name, 131072, {"available_bytes": 3 * GIB}, VllmOptions(), False))  # too small
        out.append((name, 1048576, {"available_bytes": 12 * GIB}, VllmOptions(), True))  # --max-model-len auto
        out.append((name, 16384, {"available_bytes": 20 * GIB}, VllmOptions(tp=2, cache_dtype="fp8"), False))
    scout, nxt = "meta-llama/Llama-4-Scout-17B-16E-Instruct", "Qwen/Qwen3-Next-80B-A3B-Instruct"
    out.append((scout, 65536, {"available_bytes": 40 * GIB},
                VllmOptions(allow_chunked_local_attn_with_hybrid_kv_cache=False), False))
    out.append((nxt, 65536, {"available_bytes": 40 * GIB}, VllmOptions(enable_prefix_caching=False), False))
    out.append((nxt, 65536, {"available_bytes": 40 * GIB}, VllmOptions(gdn_prefill_backend="triton"), False))
    return out


def _request(name, mml, budget, opts, auto_fit):
    _, g = geom(name)
    hma, _ = hybrid_kv_cache_manager(g, opts)
    specs = vllm_layer_specs(g, opts, max_model_len=mml)
    return {"specs": [dataclasses.asdict(s) for s in specs], "max_model_len": mml,
            "available_bytes": budget.get("available_bytes", 0), **budget, "auto_fit": auto_fit,
            "max_num_batched_tokens": opts.max_num_batched_tokens, "async_scheduling": opts.async_scheduling,
            "hybrid_kv_cache_manager": hma, "mamba_cache_mode": opts.mamba_cache_mode}


def test_kvprobes_plan_is_vllms_plan(vllm_env):
    cases = _cases()
    answers = run_json(vllm_env, ["-m", "kvprobe.targets.shadow.vllm.kvplan"], [_request(*c) for c in cases])
    compared = errors = 0
    for (name, mml, budget, opts, auto_fit), got in zip(cases, answers, strict=True):
        what = f"{name} max_model_len={mml} {budget} {opts} auto_fit={auto_fit}"
        _, g = geom(name)
        try:
            ours = vllm_kv_plan(g, max_model_len=mml, opts=opts, auto_fit=auto_fit,
                                available_bytes=budget.get("available_bytes"),
                                num_gpu_blocks_override=budget.get("num_gpu_blocks_override"))
        except ConfigError as err:
            assert "error" in got, f"{what}: kvprobe refused ({err}) but vLLM planned {got}"
            mine = str(err).removeprefix(f"{err.key}: ") if err.key else str(err)
            assert mine == got["error"] or got["error"].startswith(mine.split(" Try")[0]), what
            errors += 1
            continue
        assert "error" not in got, f"{what}: vLLM refused: {got['error']}"
        assert [(x.spec, list(x.layers), x.block_size, x.page_size_bytes) for x in ours.groups] == \
            [(x["spec"], x["layers"], x["block_size"], x["page_size_bytes"]) for x in got["groups"]], what
        assert (ours.num_blocks, ours.kv_tokens, ours.max_model_len, ours.in_flight_tokens) == \
            (got["num_blocks"], got["kv_tokens"], got["max_model_len"], got["in_flight_tokens"]), what
        assert ours.max_concurrency == got["max_concurrency"], what
        compared += 1
    print(f"{compared} plans identical to vLLM's, {errors} refusals with vLLM's message")
    assert (compared, errors) == (39, 6)  # both paths really exercised
