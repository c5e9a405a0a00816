"""The simulation's first-chunk admission (policy vllm-0.11) against vLLM's own schedulers.

vLLM 0.33.0 with `scheduler_reserve_full_isl=False` and 0.18.1 (the last release before 0.19.0, which
has only that rule) run, in their own environments, the closed loop of
expectations/diff/vllm-full-prompt-shadow.yaml's shape: P=3000 over a 2,048-token budget (two
chunks), O=64, 2,000 blocks of 16, at the deep levels' 14 and 20 users. A waiting request's first
chunk is admitted whenever it fits, the next one takes the budget's rest, and the newest is preempted
when the second chunks find no blocks (v1/core/sched/scheduler.py, the running loop's
`preempted_req == request` break: 0.33.0 L978, 0.18.1 L494): about one preemption per finished
request (~138 per 1k steps async, ~144 sync), which is what the ledger predicts. Running, waiting,
the usage gauge and the preemptions in the window must equal the scheduler's
(tests/theory/real/vllm_driver.py).
"""

from __future__ import annotations

import pytest

from kvprobe.theory.schedsim import VllmConfig
from tests.engine_envs import engine_env
from tests.theory.test_real_vllm import _case, _run_driver, model_dir  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow

P, O, USERS, WIDTH = 3000, 64, (14, 20), 12  # noqa: E741  (the shape; WIDTH: the limit ~10, ramped as the ledger does)
RELEASES = {"0.33.0": {"reserve_full_isl": False}, "0.18.1": {}}  # 0.18.1 has no such flag
# The usage gauge's window mean: exact on 0.33.0; on 0.18.1 a few block-steps apart over the window
# (1.3e-6 to 3.8e-6 of the pool, one block held a step longer or shorter now and then; not traced
# to its line). Running, waiting and the preemptions, what admission is about, are exact on both.
USAGE_ABS = {"0.33.0": 1e-9, "0.18.1": 1e-5}


def _cfg(async_scheduling: bool) -> VllmConfig:
    return VllmConfig(num_gpu_blocks=2000, block_size=16, max_num_seqs=256, max_num_batched_tokens=2048,
                      max_model_len=4096, policy="vllm-0.11", async_scheduling=async_scheduling)


@pytest.fixture(scope="module", params=list(RELEASES))
def results(request, model_dir) -> tuple[str, dict]:  # noqa: F811
    """(release, {(async, users): (simulation, vLLM's figures)}), vLLM's from one driver run."""
    version = request.param
    env = engine_env("vllm", version, request.config)
    cases = {(a, n): _case(model_dir, _cfg(a), P, O, n, 0, WIDTH, 8, 2) for a in (True, False) for n in USERS}
    real = _run_driver(env, [{**spec, **RELEASES[version]} for _, spec in cases.values()])
    return version, {key: (sim, r) for (key, (sim, _)), r in zip(cases.items(), real, strict=True)}


@pytest.mark.parametrize("users", USERS)
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_first_chunk_preemptions_equal_vllms_scheduler(results, async_scheduling, users):
    version, by_case = results
    sim, real = by_case[(async_scheduling, users)]
    assert (sim.running_mean, sim.waiting_mean) == pytest.approx((real["running"], real["waiting"]), abs=1e-9), version
    real_rate = real["window_preemptions"] * 1000 / sim.steps
    assert sim.preemptions_per_1k_steps == pytest.approx(real_rate, abs=1e-9), version
    # the shape's churn: over 100 preemptions per 1k steps, one per finished request or so
    assert sim.preemptions_per_1k_steps > 100, version
    assert sim.usage_mean == pytest.approx(real["usage"], abs=USAGE_ABS[version]), version
    # vllm:num_preemptions counts the PREEMPTED events a request's next output carries: the same
    # preemptions, a few steps later (at most one or two cross the window's ends)
    assert abs(real["window_reported_preemptions"] - real["window_preemptions"]) <= 2, version
