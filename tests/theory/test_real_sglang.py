"""The simulation against SGLang 0.5.23's own Scheduler, step by step (strongest check).

SGLang's real `Scheduler` — PrefillAdder and schedule_policy, ReqToTokenPool and the token
allocator, the radix cache, update_running_batch with retract_decode, the new_token_ratio
tracker, process_batch_result, in its overlap event loop — is built with only the model replaced
(tests/theory/real/sglang_driver.py) and driven through the same closed loop as kvprobe's
simulation: the same arrivals, prompts and resubmissions. After every step the two must agree
exactly on running, waiting, used tokens, retractions and new_token_ratio. The environment is
installed when missing (tests/theory/conftest.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from kvprobe.theory.schedsim import (
    SglangConfig,
    SimRequest,
    arrival_steps,
    make_scheduler,
    request_lifetime,
    workload_prompt,
)

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
    sched, count, trace, nxt = make_scheduler(cfg), 0, [], 0

    def submit():
        nonlocal count
        sched.add(SimRequest(f"u{count}", workload_prompt(count, P, K), O, ignore_eos=ignore_eos, eos_after=eos_after))
        count += 1

    for t in range(steps):
        while nxt < users and arrivals[nxt] <= t:
            submit()
            nxt += 1
        result = sched.step()
        trace.append([sched.run.n + (sched.chunked is not None), len(sched.waiting), sched.pool.used,
                      sched.stats.retracted_total, round(sched.ratio, 9)])
        for _ in result.finished:
            submit()
    return trace


def real_traces(env, cases: list[dict]) -> list[dict]:
    """SGLang's own traces for `cases` (real_spec dicts), one driver run: SGLang is imported once and
    each case runs in a fresh forked process (tests/theory/real/sglang_driver.py)."""
    out = subprocess.run([str(env.python), str(DRIVER), json.dumps(cases)], capture_output=True, text=True,
                         timeout=900, start_new_session=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line[len("TRACE "):]) for line in out.stdout.splitlines() if line.startswith("TRACE ")]
    assert len(results) == len(cases), out.stdout[-2000:] + out.stderr[-3000:]
    return results


def real_spec(model_dir, cfg: SglangConfig, P, O, K, users, arrivals, steps, ignore_eos, eos_after=None) -> dict:  # noqa: E741
    return dict(model_dir=model_dir, config=dataclasses.asdict(cfg), P=P, O=O, K=K, users=users, arrivals=arrivals,
                steps=steps, ignore_eos=ignore_eos, eos_after=eos_after)


BASE = SglangConfig(max_total_num_tokens=16384, context_len=8192)
SHAPES = {
    # issue 12: radix off runs 4 (mean 3.98), radix on 3
    "radix off, P=512 O=4096": (dataclasses.replace(BASE, disable_radix_cache=True), 512, 4096, 0, 8, "ramp", True, 14000),
    "radix on, P=512 O=4096": (BASE, 512, 4096, 0, 8, "ramp", True, 14000),
    # issue 12: the exact fit M = 30 (P + O) runs at most 30
    "exact fit, ramp": (SglangConfig(max_total_num_tokens=30000, context_len=8192), 700, 300, 0, 40, "ramp", True, 4000),
    "exact fit, burst": (SglangConfig(max_total_num_tokens=30000, context_len=8192), 700, 300, 0, 40, "burst", True, 4000),
    # without ignore_eos the reservation is scaled by new_token_ratio: the pool fills and decode retracts
    "retraction": (BASE, 512, 256, 0, 40, "ramp", False, 4000),
    "shared prefix 256": (BASE, 512, 256, 256, 40, "ramp", True, 3000),
    "shared prefix, pages of 4, chunks of 256": (dataclasses.replace(BASE, page_size=4, chunked_prefill_size=256),
                                                 512, 256, 202, 40, "ramp", False, 3000),
    "overlap off, retraction": (dataclasses.replace(BASE, overlap=False), 512, 256, 0, 40, "burst", False, 3000),
    "max_running_requests 12": (dataclasses.replace(BASE, max_running_requests=12), 512, 256, 0, 40, "ramp", True, 2000),
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


def _case(name: str):
    cfg, P, O, K, users, start, ignore_eos, steps, *eos = SHAPES[name]  # noqa: E741
    return cfg, P, O, K, users, _arrivals(cfg, P, O, users, start), steps, ignore_eos, *eos


@pytest.fixture(scope="module")
def sglang_traces(sglang_env, model_dir) -> dict[str, dict]:
    """SGLang's trace of every shape, from one driver run (one import of SGLang, not one per shape)."""
    names = list(SHAPES)
    return dict(zip(names, real_traces(sglang_env, [real_spec(model_dir, *_case(n)) for n in names]), strict=True))


@pytest.mark.parametrize("name", list(SHAPES))
def test_simulation_equals_sglangs_scheduler_step_by_step(sglang_traces, name):
    real = sglang_traces[name]
    assert "error" not in real, real.get("error")
    real = real["trace"]
    sim = model_trace(*_case(name))
    first = next((t for t, (a, b) in enumerate(zip(sim, real, strict=True)) if a != b), None)
    assert first is None, (f"step {first}: simulation {sim[first]} vs SGLang {real[first]} "
                           f"(running, waiting, used tokens, retractions, new_token_ratio)")
    assert max(row[0] for row in sim) > 1  # requests ran concurrently: the shape exercises admission
