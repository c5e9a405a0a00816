"""A hybrid model's first-chunk admission against vLLM 0.18.1's own Scheduler and AsyncScheduler.

expectations/diff/vllm-hybrid-window-shadow.yaml's shape on 0.18.1: gpt-oss-20b's window group (128)
and full group in one pool of 400 blocks of 16, P=1000, O=200, a 512-token budget, max_num_seqs 16,
at the deep levels' 7 and 9 closed-loop users, async and sync. The scheduler config is the ledger's
(policy vllm-0.11, 0.18.1's window rules). A request is admitted on its first chunk, the pool fills
and requests are preempted; a preempted request comes back to the prefix cache. Three rules of
0.18.1 decide where it lands (theory/vllm/releases.py SPARSE_RETENTION_FROM, UNHASHED_FIRST_FROM):
- every full block of the window group is cached (no sparse retention): a preempted request's hit
  reaches its prompt's end, and its admission charges the hit blocks and the rest of the prompt in
  one chunk (103 blocks where a fresh first chunk takes 64), so it waits rather than comes back and is
  preempted again;
- every freed block goes to the tail of the free queue (block_pool.py L409-423, no unhashed-first
  split), so the blocks a preempted request freed last are evicted first;
- what left the window is freed on the computed tokens (kv_cache_manager.py L334-336): the simulation's
  shortcut for a request whose allocate_slots would do nothing reads the same basis.
The running and waiting counts and the free blocks must equal the scheduler's after every step
(tests/theory/real/vllm_driver.py), and the closed loop the ledger measures must give the
scheduler's window means.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.schedsim import VllmConfig, arrival_steps, closed_loop, request_lifetime
from kvprobe.theory.vllm.hybrid.block_pool import SPLIT, TAIL
from kvprobe.theory.vllm.hybrid.kv_cache_manager import KVGroup
from tests.engine_envs import engine_env
from tests.theory.test_real_vllm import _run_driver, model_dir  # noqa: F401  (the fixture)
from tests.theory.test_real_vllm_hybrid import driver_spec, simulated

pytestmark = pytest.mark.slow

P, O, USERS, WIDTH, STEPS = 1000, 200, (7, 9), 8, 1500  # noqa: E741  (WIDTH: the ledger's ramp)
LIFETIMES, WARMUP = 6, 1


def ledger_config(async_scheduling: bool) -> VllmConfig:
    led = build_ledger(LedgerInputs(
        engine="vllm", model="openai/gpt-oss-20b", engine_version="0.18.1", max_model_len=4096, max_num_seqs=16,
        max_num_batched_tokens=512, num_gpu_blocks_override=400, block_size=16, async_scheduling=async_scheduling,
        prompt_tokens=P, output_tokens=O))
    cfg = led.scheduler_config
    assert cfg.groups == (KVGroup("sliding", window=128), KVGroup("full"))
    assert (cfg.policy, cfg.window_admission_cap, cfg.window_in_flight) == ("vllm-0.11", False, False)
    assert (cfg.sparse_retention, cfg.free_order) == (False, TAIL)  # releases.py: 0.29.0, 0.23.0
    return cfg


CASES = [(a, n) for a in (True, False) for n in USERS]


@pytest.fixture(scope="module")
def real(request, model_dir) -> dict:  # noqa: F811
    """vLLM 0.18.1's trace of every case ("trace", a) and its window means ("means", a), one driver run."""
    env = engine_env("vllm", "0.18.1", request.config)
    keys, specs = [], []
    for a, n in CASES:
        cfg = ledger_config(a)
        arrivals = arrival_steps(request_lifetime(cfg, P, O), n, "ramp", WIDTH)
        keys.append(("trace", a, n))
        specs.append(driver_spec(model_dir, cfg, P, O, n, arrivals, STEPS))
        life = request_lifetime(cfg, P, O)
        t0 = arrivals[-1] + math.ceil(WARMUP * life)
        sim = closed_loop(cfg, P, O, n, ramp_width=WIDTH, lifetimes=LIFETIMES, warmup_lifetimes=WARMUP, batches=4)
        keys.append(("means", a, n))
        specs.append({**driver_spec(model_dir, cfg, P, O, n, arrivals, t0 + sim.steps), "t0": t0, "trace": False})
    return dict(zip(keys, _run_driver(env, specs), strict=True))


@pytest.mark.parametrize("async_scheduling, users", CASES)
def test_every_step_equals_vllm_0_18_1s_scheduler(real, async_scheduling, users):
    cfg = ledger_config(async_scheduling)
    sim, preemptions = simulated(cfg, P, O, users, arrival_steps(request_lifetime(cfg, P, O), users, "ramp", WIDTH),
                                 STEPS)
    engine = [tuple(x) for x in real[("trace", async_scheduling, users)]["trace"]]
    first = next((t for t, (a, b) in enumerate(zip(sim, engine, strict=True)) if a != b), None)
    assert first is None, f"step {first}: simulated {sim[first]}, vLLM {engine[first]}"
    assert max(w for _, w, _ in sim) > 0 and preemptions > 0  # the pool binds: requests wait and are preempted
    assert preemptions == real[("trace", async_scheduling, users)]["preemptions"]


@pytest.mark.parametrize("rule", [{"sparse_retention": True}, {"free_order": SPLIT}], ids=["retention", "free order"])
def test_each_of_0_33_0s_pool_rules_parts_from_0_18_1(real, rule):
    """With either pool rule of 0.33.0 in place of 0.18.1's, the loop parts from the scheduler: the test sees both."""
    for a, n in CASES:
        cfg = dataclasses.replace(ledger_config(a), **rule)
        sim, _ = simulated(cfg, P, O, n, arrival_steps(request_lifetime(cfg, P, O), n, "ramp", WIDTH), STEPS)
        assert sim != [tuple(x) for x in real[("trace", a, n)]["trace"]], (rule, a, n)


@pytest.mark.parametrize("async_scheduling, users", CASES)
def test_the_ledgers_closed_loop_equals_vllm_0_18_1s_means(real, async_scheduling, users):
    cfg = ledger_config(async_scheduling)
    sim = closed_loop(cfg, P, O, users, ramp_width=WIDTH, lifetimes=LIFETIMES, warmup_lifetimes=WARMUP, batches=4)
    r = real[("means", async_scheduling, users)]
    assert (sim.running_mean, sim.waiting_mean) == pytest.approx((r["running"], r["waiting"]), abs=1e-9)
    assert sim.usage_mean == pytest.approx(r["usage"], abs=1e-9)
    assert sim.preemptions_per_1k_steps == pytest.approx(r["window_preemptions"] * 1000 / sim.steps, abs=1e-9)
    # the shadow's figures (running 4.22-4.38, 24-30 preemptions per 1k steps), not the 4.06 and 65 of
    # 0.33.0's pool rules
    assert 4.1 < sim.running_mean < 4.4 and 15 < sim.preemptions_per_1k_steps < 40
