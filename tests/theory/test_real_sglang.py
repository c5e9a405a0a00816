"""The simulation against SGLang 0.5.23's own Scheduler, step by step (strongest check).

SGLang's real `Scheduler` — PrefillAdder and schedule_policy, ReqToTokenPool and the token
allocator, the radix cache, update_running_batch with retract_decode, the new_token_ratio
tracker, process_batch_result, in its overlap event loop — is built with only the model replaced
(tests/theory/real/sglang_driver.py) and driven through the same closed loop as kvprobe's
simulation: the same arrivals, prompts and resubmissions. After every step the two must agree
exactly on running, waiting, used tokens, retractions and new_token_ratio. The hybrid shapes run a
gpt-oss-shaped model (a sliding-window pool beside the full one; the radix cache off:
sglang/swa/scheduler.py, on: sglang/swa/radix.py) and compare the used tokens of both pools. The environment is
installed when missing (tests/theory/conftest.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvprobe.theory.model.geometry import geometry_from_config
from kvprobe.theory.schedsim import (
    SglangConfig,
    SimRequest,
    arrival_steps,
    make_scheduler,
    request_lifetime,
    workload_prompt,
)
from kvprobe.theory.sglang.pools import SglangOptions, sglang_pools

DRIVER = Path(__file__).with_name("real") / "sglang_driver.py"
pytestmark = pytest.mark.slow

# A Llama-shaped model small enough that SGLang's real KV buffers (1 layer, 1 KV head) stay a few MB;
# the pool is sized by --max-total-tokens, so the geometry changes nothing the scheduler decides.
# The vocabulary holds kvprobe's unique prompt ids (50000 + serial).
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64, "num_hidden_layers": 1,
         "vocab_size": 200000, "max_position_embeddings": 65536, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
         "transformers_version": "4.46.0"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang-model")
    (d / "config.json").write_text(json.dumps(MODEL))
    return str(d)


def _arrivals(cfg: SglangConfig, P: int, O: int, users: int, start: str) -> list[int]:  # noqa: E741
    """closed_loop's arrival steps: a ramp one lifetime wide, or everyone at step 0."""
    return arrival_steps(request_lifetime(cfg, P, O), users, start)


def model_trace(cfg: SglangConfig, P, O, K, users, arrivals, steps, ignore_eos, eos_after=None) -> list[list]:  # noqa: E741
    """kvprobe's scheduler through the same loop, observed as the driver observes SGLang's."""
    return model_run(cfg, P, O, K, users, arrivals, steps, ignore_eos, eos_after)[0]


def model_run(cfg: SglangConfig, P, O, K, users, arrivals, steps, ignore_eos, eos_after=None):  # noqa: E741
    """model_trace, and the first step at which the model says it no longer follows SGLang (a
    retracted request re-admitted onto its old tree path, sglang/swa/radix.py), or None."""
    sched, count, trace, nxt, beyond = make_scheduler(cfg), 0, [], 0, None

    def submit():
        nonlocal count
        sched.add(SimRequest(f"u{count}", workload_prompt(count, P, K), O, ignore_eos=ignore_eos, eos_after=eos_after))
        count += 1

    for t in range(steps):
        while nxt < users and arrivals[nxt] <= t:
            submit()
            nxt += 1
        result = sched.step()
        used = [sched.pool.used] + ([sched.swa.used] if hasattr(sched, "swa") else [])
        trace.append([sched.run.n + (sched.chunked is not None), len(sched.waiting), *used,
                      sched.stats.retracted_total, round(sched.ratio, 9)])
        if beyond is None and sched.stats.swa_radix_readopted:
            beyond = t
        for _ in result.finished:
            submit()
    return trace, beyond


def real_traces(env, cases: list[dict]) -> list[dict]:
    """SGLang's own traces for `cases` (real_spec dicts), one driver run: SGLang is imported once and
    each case runs in a fresh forked process (tests/theory/real/sglang_driver.py)."""
    # TMPDIR of its own: each Scheduler's PortArgs names its sockets after temporary files SGLang never
    # deletes (srt/server_args.py, five a scheduler; 195 left in /tmp by one suite)
    with tempfile.TemporaryDirectory(prefix="kvprobe-sglang-driver-") as scratch:
        out = subprocess.run([str(env.python), str(DRIVER), json.dumps(cases)], capture_output=True, text=True,
                             timeout=900, start_new_session=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TMPDIR": scratch})
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line[len("TRACE "):]) for line in out.stdout.splitlines() if line.startswith("TRACE ")]
    assert len(results) == len(cases), out.stdout[-2000:] + out.stderr[-3000:]
    return results


def real_spec(model_dir, cfg: SglangConfig, P, O, K, users, arrivals, steps, ignore_eos, eos_after=None,  # noqa: E741
              server_args=None) -> dict:
    return dict(model_dir=model_dir, config=dataclasses.asdict(cfg), P=P, O=O, K=K, users=users, arrivals=arrivals,
                steps=steps, ignore_eos=ignore_eos, eos_after=eos_after, server_args=server_args or {})


BASE = SglangConfig(max_total_num_tokens=16384, context_len=8192)
SHAPES = {
    # issue 12: radix off runs 4 (mean 3.98), radix on 3
    "radix off, P=512 O=4096": (dataclasses.replace(BASE, disable_radix_cache=True),
                                512, 4096, 0, 8, "ramp", True, 14000),
    "radix on, P=512 O=4096": (BASE, 512, 4096, 0, 8, "ramp", True, 14000),
    # issue 12: the exact fit M = 30 (P + O) runs at most 30
    "exact fit, ramp": (SglangConfig(max_total_num_tokens=30000, context_len=8192),
                        700, 300, 0, 40, "ramp", True, 4000),
    "exact fit, burst": (SglangConfig(max_total_num_tokens=30000, context_len=8192),
                         700, 300, 0, 40, "burst", True, 4000),
    # without ignore_eos the reservation is scaled by new_token_ratio: the pool fills and decode retracts
    "retraction": (BASE, 512, 256, 0, 40, "ramp", False, 4000),
    "shared prefix 256": (BASE, 512, 256, 256, 40, "ramp", True, 3000),
    "shared prefix, pages of 4, chunks of 256": (dataclasses.replace(BASE, page_size=4, chunked_prefill_size=256),
                                                 512, 256, 202, 40, "ramp", False, 3000),
    "overlap off, retraction": (dataclasses.replace(BASE, overlap=False), 512, 256, 0, 40, "burst", False, 3000),
    "max_running_requests 12": (dataclasses.replace(BASE, max_running_requests=12),
                                512, 256, 0, 40, "ramp", True, 2000),
    "radix off, retraction, chunks": (dataclasses.replace(BASE, disable_radix_cache=True, chunked_prefill_size=1000),
                                      900, 600, 0, 30, "ramp", False, 4000),
    # an EOS nobody knows in advance: reserved by new_token_ratio, finished early
    "EOS at 100 of 400": (BASE, 512, 400, 0, 40, "ramp", False, 3000, 100),
    "EOS, no overlap, shared prefix": (dataclasses.replace(BASE, overlap=False), 512, 400, 300, 40, "burst", False,
                                       3000, 150),
    "long prompts in chunks of 1024": (dataclasses.replace(BASE, chunked_prefill_size=1024), 3000, 500, 0, 12,
                                       "ramp", False, 4000),
    "no chunking, prefill budget 1024": (dataclasses.replace(BASE, chunked_prefill_size=-1, max_prefill_tokens=1024),
                                         600, 300, 0, 40, "burst", True, 2000),
    "pages of 16, shared prefix 100, conservativeness 0.5": (
        dataclasses.replace(BASE, page_size=16, schedule_conservativeness=0.5), 512, 300, 100, 40, "ramp", False, 3000),
    "radix off, pages of 8": (dataclasses.replace(BASE, disable_radix_cache=True, page_size=8), 500, 700, 0, 30,
                              "ramp", True, 4000),
    # outputs beyond SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: reserved as 4096, so decode runs out and retracts
    "O=6000, beyond the clip": (BASE, 512, 6000, 0, 6, "ramp", True, 14000),
    "radix off, O=5000, burst": (dataclasses.replace(BASE, disable_radix_cache=True), 512, 5000, 0, 6, "burst", True,
                                 12000),
    "max_running_requests 12, radix off, retraction": (
        dataclasses.replace(BASE, max_running_requests=12, disable_radix_cache=True, max_total_num_tokens=8000),
        512, 512, 0, 30, "ramp", False, 3000),
}


# A gpt-oss-shaped model (GptOssForCausalLM: one sliding-window layer of sliding_window 128, so the
# scheduler's window is 127, models/gpt_oss.py L131-132, and one full layer) for the hybrid shapes.
# Its pools come from kvprobe's own sizing (sglang_pools), which the driver's SGLang must reproduce.
GPT_OSS = {**MODEL, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 2,
           "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128, "num_local_experts": 2,
           "num_experts_per_tok": 1, "experts_per_token": 1, "attention_bias": True, "swiglu_limit": 7.0,
           "vocab_size": 201088, "pad_token_id": 0, "rope_theta": 150000}
# gpt-oss asserts a GPU attention backend at startup (arg_groups/model_hook.py L530-540); none is built
GPT_OSS_ARGS = {"attention_backend": "triton"}


# Llama 4 (Llama4ForConditionalGeneration): every 4th layer full, the others windowed by
# attention_chunk_size (configs/model_config.py L2700-2712, load_model_utils.py L144-157), the same
# two pools and scheduler as gpt-oss; a chunk of 128 here, 4 layers
LLAMA4 = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "tie_word_embeddings": False,
          "torch_dtype": "bfloat16", "boi_token_index": 200080, "eoi_token_index": 200081, "image_token_index": 200092,
          "text_config": {**{k: MODEL[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                    "head_dim", "max_position_embeddings", "rms_norm_eps",
                                                    "bos_token_id", "eos_token_id", "intermediate_size")},
                          "model_type": "llama4_text", "num_hidden_layers": 4, "attention_chunk_size": 128,
                          "intermediate_size_mlp": 128, "num_local_experts": 2, "num_experts_per_tok": 1,
                          "interleave_moe_layer_step": 1, "no_rope_layers": [], "use_qk_norm": True,
                          "vocab_size": 202048, "rope_theta": 500000.0, "attention_bias": False,
                          "hidden_act": "silu", "pad_token_id": 0},
          "vision_config": {"hidden_size": 64, "image_size": 336, "intermediate_size": 128,
                            "model_type": "llama4_vision_model",
                            "num_attention_heads": 1, "num_channels": 3, "num_hidden_layers": 1, "patch_size": 14,
                            "pixel_shuffle_ratio": 0.5, "projector_input_dim": 64, "projector_output_dim": 64,
                            "vision_output_dim": 64, "norm_eps": 1e-5, "rope_theta": 10000,
                            "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
                            "multi_modal_projector_bias": False, "projector_dropout": 0.0, "attention_dropout": 0.0,
                            "hidden_act": "gelu", "initializer_range": 0.02}}


def hybrid_config(M: int, opts: SglangOptions, model: dict = GPT_OSS, **sim) -> tuple[SglangConfig, dict]:  # noqa: N803
    """The scheduler config of `model` with a pool cap of M tokens, and the server args that say the
    same to SGLang: the window pool and max_running_requests as kvprobe sizes them."""
    pools = sglang_pools(model, geometry_from_config(model, "tiny"), context_len=8192, max_total_tokens=M, opts=opts)
    cfg = SglangConfig(max_total_num_tokens=pools.max_total_num_tokens, page_size=opts.page_size,
                       max_running_requests=pools.max_running_requests, chunked_prefill_size=opts.chunked_prefill_size,
                       disable_radix_cache=opts.disable_radix_cache, overlap=not opts.disable_overlap_schedule,
                       sliding_window_size=pools.layout.sliding_window_size, swa_pool_tokens=pools.swa_tokens, **sim)
    args = {**(GPT_OSS_ARGS if model is GPT_OSS else {}), "swa_full_tokens_ratio": opts.swa_full_tokens_ratio,
            "max_running_requests": opts.max_running_requests}
    return cfg, args


RATIO = SglangOptions(disable_radix_cache=True, swa_full_tokens_ratio=0.1)
HYBRID_SHAPES = {  # (config, server args), P, O, users, start, ignore_eos, steps
    # the window pool (800) binds at 4 while the full pool (8000) holds 11
    "swa: window pool binds": (hybrid_config(8000, RATIO), 300, 400, 12, "ramp", True, 2500),
    # the full pool binds; new_token_ratio reservations, decode runs out and retracts
    "swa: full pool binds, retraction": (hybrid_config(4000, dataclasses.replace(RATIO, swa_full_tokens_ratio=0.5)),
                                         300, 400, 20, "burst", False, 2500),
    # the window pool runs out in decode: retraction on the window
    "swa: window retraction": (hybrid_config(8000, dataclasses.replace(RATIO, swa_full_tokens_ratio=0.0875)),
                               200, 600, 12, "ramp", False, 3000),
    # prompts in chunks: the window below a chunked request's earlier chunks is freed as it extends
    # (two chunks back with overlap)
    "swa: chunks of 512": (hybrid_config(16000, dataclasses.replace(RATIO, chunked_prefill_size=512,
                                                                    swa_full_tokens_ratio=0.2)),
                           1500, 300, 8, "ramp", True, 2000),
    "swa: chunks of 512, overlap off": (
        hybrid_config(16000, dataclasses.replace(RATIO, chunked_prefill_size=512, swa_full_tokens_ratio=0.2,
                                                 disable_overlap_schedule=True)), 1500, 300, 8, "ramp", False, 2000),
    # a prompt whose window charge never fits the window pool is cut to what the window holds
    "swa: prompt beyond the window pool": (hybrid_config(8000, dataclasses.replace(RATIO, chunked_prefill_size=1024)),
                                           1500, 300, 6, "ramp", False, 1500),
    # --max-running-requests with the radix cache off: the window pool sized per request
    # (SWARequestCapPoolConfigurator), pages of 16
    "swa: request-capped window pool, pages of 16": (
        hybrid_config(16000, SglangOptions(disable_radix_cache=True, page_size=16, max_running_requests=8,
                                           chunked_prefill_size=512)), 300, 500, 12, "ramp", True, 2500),
    "swa: pages of 16, window binds": (hybrid_config(8000, dataclasses.replace(RATIO, page_size=16)),
                                       250, 500, 12, "ramp", False, 2500),
    "swa: Llama 4 chunked layers, window binds": (hybrid_config(8000, RATIO, LLAMA4), 300, 400, 12, "ramp", True, 1500),
}

# The radix cache on (SGLang's default; sglang/swa/radix.py). Each shape: as HYBRID_SHAPES, then
# the step the model must follow SGLang through at least. The model follows SGLang exactly until
# a retracted request is re-admitted onto its old prompt path (SGLang re-adopts the path's full-only
# nodes: not modelled); it flags that step itself, and the comparison stops there. None: never.
ON = SglangOptions(swa_full_tokens_ratio=0.1)
RADIX_SHAPES = {
    # the window binds (3 run while the full pool holds 11); running windows outgrow it: retraction
    "swa radix on: window binds": (hybrid_config(8000, ON), 300, 400, 12, "ramp", True, 850, 800),
    # the full pool binds, retraction; the retracted prompts leave the tree before they come back
    "swa radix on: full pool binds, retraction": (
        hybrid_config(4000, dataclasses.replace(ON, swa_full_tokens_ratio=0.5)), 300, 400, 20, "burst", False, 2500,
        None),
    # chunks: each chunk's prefix enters the tree; a last chunk of 76 locks its node and the 127
    # above it; the checkpoint moves the decode eviction's base (evicted) to the earlier chunk's end
    "swa radix on: chunks of 512": (hybrid_config(16000, dataclasses.replace(ON, chunked_prefill_size=512,
                                                                         swa_full_tokens_ratio=0.2)),
                                    1100, 300, 10, "ramp", True, 400, 350),
    # pages of 16, chunks of 256, a burst: requests of equal outputs retracted last-in-batch first
    "swa radix on: pages of 16, chunks of 256, retraction": (
        hybrid_config(16000, dataclasses.replace(ON, chunked_prefill_size=256, page_size=16,
                                                 swa_full_tokens_ratio=0.15)), 700, 300, 12, "burst", False, 200, 180),
    "swa radix on: pages of 16, window binds": (hybrid_config(8000, dataclasses.replace(ON, page_size=16)),
                                                250, 500, 12, "ramp", False, 600, 540),
    "swa radix on: Llama 4 chunked layers, window binds": (hybrid_config(8000, ON, LLAMA4), 300, 400, 12, "ramp",
                                                           True, 480, 430),
}
HYBRID_MODELS = {"swa: Llama 4 chunked layers, window binds": LLAMA4,
                 "swa radix on: Llama 4 chunked layers, window binds": LLAMA4}  # the others: GPT_OSS


# Models whose admission is the plain scheduler's although their layers are not all full attention:
# Mistral v0.1 (a window on every layer) is not a hybrid-SWA architecture in SGLang 0.5.23
# (configs/model_config.py L2651-2697): one full pool. Qwen3-Next with the radix cache off: the
# full pool over its full-attention layers, and one recurrent-state slot per request with as many
# slots as max_running_requests (_handle_max_mamba_cache, kv_cache_configurator.py L3229-3409; the
# driver replaces the memory profiling it runs in, so the case says it: --max-mamba-cache-size); with
# it on (no_buffer, overlap off) and no shared prefix, the plain scheduler with its radix cache.
MISTRAL = {**MODEL, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64}
QWEN3_NEXT = {**MODEL, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 4,
              "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
              "linear_num_key_heads": 1, "linear_num_value_heads": 1, "linear_value_head_dim": 16,
              "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "norm_topk_prob": True, "partial_rotary_factor": 0.25, "rope_theta": 10000000}
RADIX_OFF = dataclasses.replace(BASE, disable_radix_cache=True)
SLOTS_12, SLOTS_40 = ({"max_running_requests": n, "max_mamba_cache_size": n} for n in (12, 40))
# the radix cache on, as a CPU runs it: no_buffer (3 slots per request), overlap off; no shared prefix
NO_BUFFER = dataclasses.replace(BASE, overlap=False)
NO_BUFFER_12, NO_BUFFER_40 = ({"max_running_requests": n, "max_mamba_cache_size": 3 * n,
                               "mamba_radix_cache_strategy": "no_buffer"} for n in (12, 40))
MODEL_SHAPES = {  # model, config, P, O, K, users, start, ignore_eos, steps, server args
    "window on every layer, one full pool, retraction": (MISTRAL, RADIX_OFF, 512, 256, 0, 40, "ramp", False, 1500, {}),
    "qwen3-next radix off: the state slots bind": (
        QWEN3_NEXT, dataclasses.replace(RADIX_OFF, max_running_requests=12), 512, 256, 0, 40, "ramp", False, 1500,
        SLOTS_12),
    "qwen3-next radix off: the full pool binds, retraction": (
        QWEN3_NEXT, dataclasses.replace(RADIX_OFF, max_running_requests=40), 512, 256, 0, 40, "burst", False, 1500,
        SLOTS_40),
    "qwen3-next no_buffer: the state slots bind": (
        QWEN3_NEXT, dataclasses.replace(NO_BUFFER, max_running_requests=12), 512, 256, 0, 40, "ramp", False, 1500,
        NO_BUFFER_12),
    "qwen3-next no_buffer: the full pool binds, retraction": (
        QWEN3_NEXT, dataclasses.replace(NO_BUFFER, max_running_requests=40), 512, 256, 0, 40, "burst", False, 1500,
        NO_BUFFER_40),
}


def _case(name: str):
    if name in MODEL_SHAPES:
        _, cfg, P, O, K, users, start, ignore_eos, steps, _ = MODEL_SHAPES[name]  # noqa: E741
        return cfg, P, O, K, users, _arrivals(cfg, P, O, users, start), steps, ignore_eos
    if name in HYBRID_SHAPES or name in RADIX_SHAPES:
        (cfg, _), P, O, users, start, ignore_eos, steps = {**HYBRID_SHAPES, **RADIX_SHAPES}[name][:7]  # noqa: E741
        return cfg, P, O, 0, users, _arrivals(cfg, P, O, users, start), steps, ignore_eos
    cfg, P, O, K, users, start, ignore_eos, steps, *eos = SHAPES[name]  # noqa: E741
    return cfg, P, O, K, users, _arrivals(cfg, P, O, users, start), steps, ignore_eos, *eos


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory) -> dict[int, str]:
    """A model folder per config.json the hybrid and other-model shapes use, by the config's id."""
    out = {}
    for m in (GPT_OSS, LLAMA4, MISTRAL, QWEN3_NEXT):
        d = tmp_path_factory.mktemp("sglang-" + m["model_type"])
        (d / "config.json").write_text(json.dumps(m))
        out[id(m)] = str(d)
    return out


@pytest.fixture(scope="module")
def sglang_traces(sglang_env, model_dir, config_dirs) -> dict[str, dict]:
    """SGLang's trace of every shape, from one driver run (one import of SGLang, not one per shape)."""
    specs = [real_spec(model_dir, *_case(n)) for n in SHAPES]
    specs += [real_spec(config_dirs[id(HYBRID_MODELS.get(n, GPT_OSS))], *_case(n), server_args=HYBRID_SHAPES[n][0][1])
              for n in HYBRID_SHAPES]
    specs += [real_spec(config_dirs[id(MODEL_SHAPES[n][0])], *_case(n), server_args=MODEL_SHAPES[n][-1])
              for n in MODEL_SHAPES]
    specs += [real_spec(config_dirs[id(HYBRID_MODELS.get(n, GPT_OSS))], *_case(n), server_args=RADIX_SHAPES[n][0][1])
              for n in RADIX_SHAPES]
    names = [*SHAPES, *HYBRID_SHAPES, *MODEL_SHAPES, *RADIX_SHAPES]
    return dict(zip(names, real_traces(sglang_env, specs), strict=True))


def _first_difference(sim: list, real: list) -> str | None:
    first = next((t for t, (a, b) in enumerate(zip(sim, real, strict=True)) if a != b), None)
    if first is None:
        return None
    used = "full pool used, window pool used" if len(real[first]) == 6 else "used tokens"
    return (f"step {first}: simulation {sim[first]} vs SGLang {real[first]} "
            f"(running, waiting, {used}, retractions, new_token_ratio)")


@pytest.mark.parametrize("name", [*SHAPES, *HYBRID_SHAPES, *MODEL_SHAPES])
def test_simulation_equals_sglangs_scheduler_step_by_step(sglang_traces, name):
    real = sglang_traces[name]
    assert "error" not in real, real.get("error")
    cfg = _case(name)[0]
    pools = [cfg.max_total_num_tokens] + ([cfg.swa_pool_tokens] if cfg.swa_pool_tokens else [])
    assert real["pool_sizes"] == pools, "SGLang sized its pools differently from kvprobe's sglang_pools"
    assert real["max_running_requests"] == cfg.max_running_requests
    sim = model_trace(*_case(name))
    diff = _first_difference(sim, real["trace"])
    assert diff is None, diff
    if name not in ONE_AT_A_TIME:
        assert max(row[0] for row in sim) > 1  # requests ran concurrently: the shape exercises admission


ONE_AT_A_TIME = {"swa: prompt beyond the window pool"}  # its window pool holds one such prompt at a time
# What each hybrid shape must exercise, so a shape that stops reaching its case fails here
HYBRID_EXERCISES = {"swa: window pool binds": "window", "swa: window retraction": "window-retract",
                    "swa: full pool binds, retraction": "retract", "swa: pages of 16, window binds": "window",
                    "swa: Llama 4 chunked layers, window binds": "window",
                    "qwen3-next radix off: the full pool binds, retraction": "retract",
                    "qwen3-next radix off: the state slots bind": "slots",
                    "qwen3-next no_buffer: the state slots bind": "slots",
                    "qwen3-next no_buffer: the full pool binds, retraction": "retract"}


@pytest.mark.parametrize("name", list(HYBRID_EXERCISES))
def test_hybrid_shapes_reach_their_case(sglang_traces, name):
    cfg, trace = _case(name)[0], sglang_traces[name]["trace"]
    what = HYBRID_EXERCISES[name]
    most = max(row[0] for row in trace)
    if what == "slots":  # every slot taken while others wait
        assert most == cfg.max_running_requests and any(w for _, w, *_ in trace)
    elif name in MODEL_SHAPES:
        assert most < cfg.max_running_requests
    if what.startswith("window"):  # someone waits while the full pool has room for another request
        P, O = HYBRID_SHAPES[name][1:3]  # noqa: E741
        assert any(w and full + P + O < cfg.max_total_num_tokens for _, w, full, *_ in trace)
    if what.endswith("retract"):
        assert trace[-1][-2] > 0


def test_a_window_one_token_off_is_caught(sglang_traces):
    """The window rule is exact: SGLang's window (127) taken as 128 diverges from its trace."""
    name = "swa: window pool binds"
    cfg, *rest = _case(name)
    off = model_trace(dataclasses.replace(cfg, sliding_window_size=cfg.sliding_window_size + 1), *rest)
    assert _first_difference(off, sglang_traces[name]["trace"]) is not None


@pytest.mark.parametrize("name", list(RADIX_SHAPES))
def test_radix_on_simulation_equals_sglangs_scheduler_until_it_says_it_cannot(sglang_traces, name):
    """The radix cache on: equal at every step up to the first step the model flags (a retracted
    request re-admitted onto its old tree path), which comes no earlier than the shape's bound,
    and only in the shapes that expect it; the equal part exercises the shape's case."""
    real = sglang_traces[name]
    assert "error" not in real, real.get("error")
    cfg, P, O = _case(name)[:3]  # noqa: E741
    assert real["pool_sizes"] == [cfg.max_total_num_tokens, cfg.swa_pool_tokens]
    sim, beyond = model_run(*_case(name))
    through = RADIX_SHAPES[name][7]
    if through is None:
        assert beyond is None, f"the model flagged a re-adoption at step {beyond}"
    else:
        assert beyond is not None and beyond >= through, beyond
    upto = len(sim) if beyond is None else beyond + 1  # the flagged step itself still agrees
    diff = _first_difference(sim[:upto], real["trace"][:upto])
    assert diff is None, diff
    seen = real["trace"][:upto]
    assert max(row[0] for row in seen) > 1
    if "window binds" in name:  # someone waits while the full pool has room; decode ran out: retraction
        assert any(w and full + P + O < cfg.max_total_num_tokens for _, w, full, *_ in seen)
        assert seen[-1][-2] > 0
    if "retraction" in name:
        assert seen[-1][-2] > 0


def test_radix_on_a_window_one_token_off_is_caught(sglang_traces):
    name = "swa radix on: window binds"
    cfg, *rest = _case(name)
    off = model_trace(dataclasses.replace(cfg, sliding_window_size=cfg.sliding_window_size + 1), *rest)
    assert _first_difference(off[:800], sglang_traces[name]["trace"][:800]) is not None
