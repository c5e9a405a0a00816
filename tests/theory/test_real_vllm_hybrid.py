"""The hybrid simulation against vLLM 0.33.0's own Scheduler and AsyncScheduler, step by step.

The same closed loop — arrivals, prompts, the model's KV cache groups — runs through kvprobe's
simulation and through vLLM's scheduler classes with a fake KV layout of the engine's own spec
classes (tests/theory/real/vllm_driver.py); the running and waiting counts and the free blocks
of the one pool must be equal after every step. The shapes are each preset's group structure
(window, chunk and Mamba groups, with their copies; Mamba with prefill checkpoint blocks) in pools
small enough that requests wait and are preempted, with prefix caching on (sparse retention, hits on
resume, Mamba "align" mode) and off (Mamba "none" mode), sync and async.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
from pathlib import Path

import pytest

from kvprobe.theory.admission import predict
from kvprobe.theory.model.geometry import load_model_config
from kvprobe.theory.schedsim import (
    SimRequest,
    VllmConfig,
    arrival_steps,
    make_scheduler,
    request_lifetime,
    workload_prompt,
)
from kvprobe.theory.vllm.hybrid.kv_cache_manager import KVGroup
from kvprobe.theory.vllm.hybrid.scheduler import HybridVllmScheduler

DRIVER = Path(__file__).with_name("real") / "vllm_driver.py"
pytestmark = pytest.mark.slow

W128, FULL = KVGroup("sliding", window=128), KVGroup("full")
SHAPES = [  # (name, config fields, P, O, users)
    ("gpt-oss: window 128 + full, sync", dict(groups=(W128, FULL), num_gpu_blocks=400), 300, 400, 30),
    ("gpt-oss: window 128 + full, async", dict(groups=(W128, FULL), num_gpu_blocks=400, async_scheduling=True),
     300, 400, 30),
    ("gpt-oss, prefix caching off", dict(groups=(W128, FULL), num_gpu_blocks=400, enable_prefix_caching=False),
     300, 400, 30),
    ("Gemma 3: six window groups + full, chunked prefill", dict(
        groups=(KVGroup("sliding", copies=6, window=100), FULL), num_gpu_blocks=600, max_num_batched_tokens=512),
     200, 1200, 30),
    ("Llama 4: three chunk groups + full, async", dict(
        groups=(KVGroup("chunked", copies=3, window=256), FULL), num_gpu_blocks=600, max_num_batched_tokens=512,
        async_scheduling=True), 700, 600, 30),
    ("Qwen3-Next: three Mamba groups + full, align", dict(
        groups=(KVGroup("mamba", copies=3), FULL), num_gpu_blocks=160, block_size=64, max_num_batched_tokens=1000,
        async_scheduling=True), 700, 400, 30),
    ("Qwen3-Next, prefix caching off (none)", dict(
        groups=(KVGroup("mamba", copies=3, block_size=4096), FULL), num_gpu_blocks=400, enable_prefix_caching=False,
        max_num_batched_tokens=1024), 300, 400, 30),
    # FlashInfer's GDN prefill (MambaSpec with one prefill checkpoint block): the final chunk spans the
    # prompt's last cacheable boundary and exports that state into a second new block, unsplit
    ("Qwen3-Next with prefill checkpoint blocks, async", dict(
        groups=(KVGroup("mamba", copies=3, checkpoint=64), FULL), num_gpu_blocks=160, block_size=64,
        max_num_batched_tokens=1000, async_scheduling=True), 700, 400, 30),
    ("Qwen3-Next with prefill checkpoint blocks, chunked prefill", dict(
        groups=(KVGroup("mamba", copies=3, checkpoint=64), FULL), num_gpu_blocks=160, block_size=64,
        max_num_batched_tokens=512), 700, 400, 30),
    # a 128-token grid: a fresh prompt's boundary (832) is off it, a resumed request's may be on it
    ("Qwen3-Next, checkpoint grid of two blocks", dict(
        groups=(KVGroup("mamba", copies=2, checkpoint=128), FULL), num_gpu_blocks=200, block_size=64,
        max_num_batched_tokens=1000), 836, 300, 30),
    # no preemption here: a request holds the most in its prefill, and the capped admission covers it
    ("Mistral 7B v0.1: every layer windowed", dict(groups=(KVGroup("sliding", window=256),), num_gpu_blocks=300,
                                                   max_num_batched_tokens=1024), 500, 700, 30),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg, _ = load_model_config("meta-llama/Llama-3.1-8B")
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2, "transformers_version": "4.46.0"}))
    return str(d)


def simulated(cfg: VllmConfig, P: int, O: int, users: int, arrivals: list[int], steps: int):  # noqa: E741
    """(running, waiting, free blocks) after every step, the pool checked for leaks each time."""
    sched, count, nxt, out = make_scheduler(cfg), 0, 0, []
    for t in range(steps):
        while nxt < users and arrivals[nxt] <= t:
            sched.add(SimRequest(f"u{count}", workload_prompt(count, P), O))
            count, nxt = count + 1, nxt + 1
        result = sched.step()
        sched.check_pool()
        out.append((sched.stats.running, sched.stats.waiting, sched.kvm.pool.num_free))
        for _ in result.finished:
            sched.add(SimRequest(f"u{count}", workload_prompt(count, P), O))
            count += 1
    return out, sched.stats.preemptions_total


def driver_spec(model_dir, cfg: VllmConfig, P, O, users, arrivals, steps, K=0) -> dict:  # noqa: E741
    return dict(model_dir=model_dir, blocks=cfg.num_gpu_blocks, block_size=cfg.block_size, P=P, O=O, users=users,
                mml=cfg.max_model_len, K=K, arrivals=arrivals, t0=0, t_end=steps, max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens, caching=cfg.enable_prefix_caching,
                groups=[g.__dict__ for g in cfg.groups], trace=True, **{"async": cfg.async_scheduling})


def engine_runs(env, specs: list[dict]) -> list[dict]:
    """Every loop through vLLM's scheduler in ONE driver process (its imports cost more than a loop):
    each loop's trace (running, waiting, free blocks after every step) and preemptions."""
    out = subprocess.run([str(env.python), str(DRIVER), json.dumps(specs)], capture_output=True, text=True,
                         timeout=900, start_new_session=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    return [{**r, "trace": [tuple(x) for x in r["trace"]]} for r in runs]


def shape_config(fields: dict) -> VllmConfig:
    return VllmConfig(**{"block_size": 16, "max_num_seqs": 256, "max_num_batched_tokens": 2048, "max_model_len": 4096,
                         **fields})


STEPS, PARTING_STEPS = 1500, 400


@pytest.fixture(scope="module")
def real(vllm_env, model_dir) -> dict:
    """vLLM's trace of every shape here, keyed by the shape's name or PARTING index."""
    keys, specs = [], []
    for name, fields, P, O, users in SHAPES:  # noqa: E741
        cfg = shape_config(fields)
        keys.append(name)
        specs.append(driver_spec(model_dir, cfg, P, O, users, arrival_steps(request_lifetime(cfg, P, O), users),
                                 STEPS))
    for i, (fields, P, O, users, K) in enumerate(PARTING):  # noqa: E741
        keys.append(i)
        specs.append(driver_spec(model_dir, parting_config(fields), P, O, users, [0] * users, PARTING_STEPS, K))
    for name in NO_PREEMPTION:  # the ledger's no-preemption limit N and N + 1, as its closed loop arrives
        _, fields, P, O, _ = next(s for s in SHAPES if s[0] == name)  # noqa: E741
        cfg, pred = no_preemption_prediction(name)
        life = request_lifetime(cfg, P, O)
        for n in (pred.clean_in_closed_loop, pred.clean_in_closed_loop + 1):
            arrivals = arrival_steps(life, n, "ramp", pred.ramp_width)
            keys.append((name, n))
            specs.append(driver_spec(model_dir, cfg, P, O, n, arrivals, arrivals[-1] + CLEAN_CHECK_LIFETIMES * life))
        n = pred.no_preemption_limit
        keys.append((name, "bound"))
        specs.append(driver_spec(model_dir, cfg, P, O, n, [0] * n, CLEAN_CHECK_LIFETIMES * life))
    return dict(zip(keys, engine_runs(vllm_env, specs), strict=True))


@pytest.mark.parametrize("name, fields, P, O, users", SHAPES, ids=[s[0] for s in SHAPES])
def test_every_step_equals_vllms_scheduler(real, name, fields, P, O, users):  # noqa: E741
    cfg = shape_config(fields)
    sim, preemptions = simulated(cfg, P, O, users, arrival_steps(request_lifetime(cfg, P, O), users), STEPS)
    engine = real[name]["trace"]
    first = next((t for t, (a, b) in enumerate(zip(sim, engine, strict=True)) if a != b), None)
    assert first is None, f"step {first}: simulated {sim[first]}, vLLM {engine[first]}"
    assert max(w for _, w, _ in sim) > 0  # the pool binds: requests wait
    assert preemptions > 0 or name.startswith("Mistral")  # and decode runs out of blocks


def test_checkpoint_blocks_are_what_makes_those_shapes_equal(real):
    """The same loops without the checkpoint blocks modelled part from vLLM at once: the test sees them."""
    for name, fields, P, O, users in SHAPES:  # noqa: E741
        if "checkpoint" not in name:
            continue
        cfg = shape_config(fields)
        stripped = dataclasses.replace(cfg, groups=tuple(dataclasses.replace(g, checkpoint=0) for g in cfg.groups))
        sim, _ = simulated(stripped, P, O, users, arrival_steps(request_lifetime(cfg, P, O), users), STEPS)
        assert sim != real[name]["trace"], name


# Async shapes with prefix caching where schedsim's count-based full-attention model
# (vllm/block_pool.py) parts from vLLM — a finishing request's last block, a resumed request's own
# blocks, a shared prefix — and the explicit pool (vllm/hybrid/kv_cache_manager.py, one full group) does not.
PARTING = [  # (config fields, P, O, users, K); every user starts at step 0
    (dict(num_gpu_blocks=69, block_size=1, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=23), 1, 22, 6, 0),
    (dict(num_gpu_blocks=10, block_size=16, max_num_seqs=7, max_num_batched_tokens=24, max_model_len=19), 8, 11, 7, 0),
    (dict(num_gpu_blocks=34, block_size=16, max_num_seqs=11, max_num_batched_tokens=26, max_model_len=142), 89, 53,
     11, 66),
]


def parting_config(fields: dict) -> VllmConfig:
    return VllmConfig(**fields, async_scheduling=True, groups=(FULL,))


@pytest.mark.parametrize("i", range(len(PARTING)))
def test_the_explicit_pool_where_the_count_model_parts(real, i):
    fields, P, O, users, K = PARTING[i]  # noqa: E741
    cfg, steps = parting_config(fields), PARTING_STEPS
    sched, count, sim = HybridVllmScheduler(cfg), 0, []
    for _ in range(users):
        sched.add(SimRequest(f"u{count}", workload_prompt(count, P, K), O))
        count += 1
    for _ in range(steps):
        result = sched.step()
        sim.append((sched.stats.running, sched.stats.waiting, sched.kvm.pool.num_free))
        for _ in result.finished:
            sched.add(SimRequest(f"u{count}", workload_prompt(count, P, K), O))
            count += 1
    assert sim == real[i]["trace"]


# The hybrid closed loop's clean region (admission.py `clean_in_closed_loop`,
# vllm/hybrid/groups.no_preemption_limit): the groups peak at different moments of a request's life
# and the closed loop interleaves requests, so its largest clean N is above every request at every
# group's peak. vLLM's scheduler runs the ledger's N clean and N + 1 not, with the ledger's ramp
# arrivals, for longer than the simulation looked (CLEAN_CHECK_LIFETIMES after the last user joined,
# against CLEAN_LIFETIMES). The bound a probe is held to (`no_preemption_limit`, every request at
# every group's peak at once) must hold whatever the phase: all its users arriving at once, vLLM
# preempts nothing.
NO_PREEMPTION = ("gpt-oss: window 128 + full, async", "Llama 4: three chunk groups + full, async",
                 "Qwen3-Next with prefill checkpoint blocks, chunked prefill", "Mistral 7B v0.1: every layer windowed")
CLEAN_CHECK_LIFETIMES = 4


@functools.cache
def no_preemption_prediction(name: str):
    _, fields, P, O, _ = next(s for s in SHAPES if s[0] == name)  # noqa: E741
    cfg = shape_config(fields)
    return cfg, predict(cfg, P, O)


@pytest.mark.parametrize("name", NO_PREEMPTION)
def test_the_closed_loop_runs_clean_up_to_the_ledgers_figure_and_no_further(real, name):
    _, pred = no_preemption_prediction(name)
    n = pred.clean_in_closed_loop
    assert n > pred.no_preemption_limit  # above every request at every group's peak at once
    at, above = real[(name, n)], real[(name, n + 1)]
    assert (max(w for _, w, _ in at["trace"]), at["preemptions"]) == (0, 0), f"N={n} is not clean in vLLM"
    assert max(w for _, w, _ in above["trace"]) > 0, f"N={n + 1} is clean in vLLM too"


@pytest.mark.parametrize("name", NO_PREEMPTION)
def test_at_the_no_preemption_bound_users_arriving_at_once_are_never_preempted(real, name):
    _, pred = no_preemption_prediction(name)
    assert real[(name, "bound")]["preemptions"] == 0, f"vLLM preempted at N={pred.no_preemption_limit}"
