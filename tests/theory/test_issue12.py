"""Issue 12: the figures the engines' own code produced (vLLM 0.33.0's Scheduler driven on a CPU,
SGLang 0.5.23's scheduler and server), long outputs, SGLang's edges, async scheduling and shared
prompt prefixes. Each prediction here is also checked against the step-by-step simulation."""

from __future__ import annotations

import dataclasses

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory.admission import predict
from kvprobe.theory.schedsim import (
    SglangConfig,
    SimRequest,
    VllmConfig,
    closed_loop,
    make_scheduler,
    workload_prompt,
)
from kvprobe.theory.sglang.radix_cache import SglangTokenPool

LONG = VllmConfig(num_gpu_blocks=6000, block_size=16, max_num_seqs=1024, max_num_batched_tokens=8192,
                  max_model_len=16384)


# ---------------------------------------------------------------- long outputs (vLLM)


def test_vllm_long_output_steady_state_is_the_engines():
    # the real scheduler, 60,000 steps from a staggered start: 19.0 running, 41 waiting, gauge 0.983
    p = predict(LONG, 1000, 8000, users=60)
    assert p.running == pytest.approx(19.0, abs=0.5)
    assert p.waiting == pytest.approx(41.0, abs=0.5)
    assert p.limit == pytest.approx(19.0, abs=0.5)  # not the 3,000-step transient's 29.97
    assert p.usage_at_limit == pytest.approx(0.983, abs=0.003)
    assert p.running_sem is not None and 0 < p.running_sem < 0.5
    assert "lifetimes of 8,000" in p.how and "SEM" in p.users_how


def test_the_window_covers_lifetimes_not_a_fixed_step_count():
    s = closed_loop(LONG, 1000, 8000, 30, lifetimes=4, batches=4)
    assert s.steps >= 4 * 8000 and s.lifetimes >= 4
    assert s.warmup >= 29 * (8000 // 30) + 2 * 8000  # every user joined, then two lifetimes settle


def test_a_burst_transient_is_not_the_steady_state():
    transient = closed_loop(LONG, 1000, 8000, 60, start="burst", lifetimes=0.2, warmup_lifetimes=0.1, batches=2)
    steady = closed_loop(LONG, 1000, 8000, 60)
    assert transient.running_mean > steady.running_mean + 5


# ---------------------------------------------------------------- SGLang's edges


def test_sglang_radix_off_runs_four_radix_on_three():
    base = SglangConfig(max_total_num_tokens=16384, context_len=8192)
    off = predict(dataclasses.replace(base, disable_radix_cache=True), 512, 4096)
    on = predict(base, 512, 4096)
    assert (off.limit, on.limit) == (4, 3)
    assert off.limit_mean == pytest.approx(3.98, abs=0.03)
    # add_one_req_ignore_eos admits the fourth once the others are far enough along; users that
    # start together stay in a cohort of three (said in the how column)
    assert "burst start settles at 3" in off.how


def test_sglang_radix_off_fourth_request_waits_for_progress():
    sched = make_scheduler(SglangConfig(max_total_num_tokens=16384, context_len=8192, disable_radix_cache=True))
    for i in range(3):
        sched.add(SimRequest(f"a{i}", workload_prompt(i, 512), 4096))
        for _ in range(700):
            sched.step()
    sched.add(SimRequest("late", workload_prompt(9, 512), 4096))
    sched.step()
    assert sched.stats.running == 4  # outputs ~2100/1400/700: the future simulation has room
    fresh = make_scheduler(SglangConfig(max_total_num_tokens=16384, context_len=8192, disable_radix_cache=True))
    for i in range(4):
        fresh.add(SimRequest(f"b{i}", workload_prompt(i, 512), 4096))
    fresh.step()
    assert fresh.stats.running == 3  # all at zero output: 4 x 4096 do not fit


def test_sglang_exact_fit_boundary():
    # M = 30 x (P + O): the real scheduler runs at most 30, mean 29.82
    p = predict(SglangConfig(max_total_num_tokens=30000, context_len=8192), 700, 300)
    assert p.limit == 30
    assert p.limit_mean == pytest.approx(29.82, abs=0.05)
    assert p.no_preemption_limit == 29  # the reservation bound that holds from any start


def test_sglang_max_running_requests_binds_at_the_boundary():
    p = predict(SglangConfig(max_total_num_tokens=30000, context_len=8192, max_running_requests=12), 700, 300)
    assert (p.limit, p.binding) == (12, "max_running_requests")


# ---------------------------------------------------------------- vLLM async scheduling


def _blocks_per_step(async_scheduling: bool, P: int = 16, O: int = 4) -> list[tuple[int, int, int]]:  # noqa: E741
    sched = make_scheduler(VllmConfig(num_gpu_blocks=50, block_size=16, enable_prefix_caching=False,
                                      async_scheduling=async_scheduling))
    sched.add(SimRequest("r", workload_prompt(0, P), O))
    trace = []
    while sched.has_work():
        result = sched.step()
        trace.append((sched.pool.usable - sched.pool.num_free, len(result.emitted), len(result.finished)))
    return trace


def test_async_allocates_one_step_earlier_and_frees_one_step_later():
    sync, asyn = _blocks_per_step(False), _blocks_per_step(True)
    # sync: prefill 16 tokens (1 block) -> token 1; decodes at positions 16, 17, 18 take block 2 at once
    assert sync == [(1, 1, 0), (2, 1, 0), (2, 1, 0), (0, 1, 1)]
    # async: the first decode is scheduled before token 1 is known (block 2 one step earlier);
    # the last token is processed a step after its batch ran, and only then are blocks freed
    assert asyn == [(1, 0, 0), (2, 1, 0), (2, 1, 0), (2, 1, 0), (0, 1, 1)]


def test_async_and_sync_plateaus_differ_slightly():
    ref = VllmConfig(num_gpu_blocks=1000, max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=4096)
    s = closed_loop(ref, 512, 256, 40, lifetimes=30)
    a = closed_loop(dataclasses.replace(ref, async_scheduling=True), 512, 256, 40, lifetimes=30)
    assert s != a
    assert a.running_mean == pytest.approx(s.running_mean, abs=0.4)
    assert 23.5 <= a.running_mean <= 24.6


# ---------------------------------------------------------------- shared prompt prefixes


def test_radix_tree_matches_whole_pages():
    for page, expect in ((1, 37), (4, 36)):
        pool = SglangTokenPool(10_000, page)
        a = tuple(range(100))
        pool.alloc(100)  # a finished request's prompt, handed to the tree
        pool.insert(a, pool.root, 0)
        b = a[:37] + tuple(range(500, 563))
        hit, n = pool.match(b, len(b) - 1)
        assert n == expect
        pool.check(0)


def test_vllm_shares_only_full_blocks():
    for K, shared in ((40, 2), (47, 2), (48, 3)):
        sched = make_scheduler(VllmConfig(num_gpu_blocks=400))
        for i in range(4):
            sched.add(SimRequest(f"r{i}", workload_prompt(i, 160, K), 8))
        sched.step()
        assert sched.pool.usable - sched.pool.num_free == shared + 4 * (10 - shared)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_shared_prefix_raises_the_limit_only_with_prefix_caching(engine):
    if engine == "vllm":
        on = VllmConfig(num_gpu_blocks=1000, max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=4096)
        off = dataclasses.replace(on, enable_prefix_caching=False)
    else:
        on = SglangConfig(max_total_num_tokens=16384, context_len=8192)
        off = dataclasses.replace(on, disable_radix_cache=True)
    plain = predict(on, 512, 256)
    shared = predict(on, 512, 256, shared_prefix_tokens=384)
    uncached = predict(off, 512, 256, shared_prefix_tokens=384)
    assert shared.limit > plain.limit * 1.5
    assert uncached.limit == pytest.approx(predict(off, 512, 256).limit, abs=0.01)
    # the prediction is the step-by-step simulation's
    slow = closed_loop(on, 512, 256, shared.probe_users, shared_prefix_tokens=384, start=shared.start,
                       ramp_width=shared.ramp_width, fast=False)
    assert shared.limit == (slow.running_max if engine == "sglang" else round(slow.running_mean, 2))
    assert shared.limit_mean == round(slow.running_mean, 2)


def test_vllm_shared_prefix_no_preemption_bound():
    cfg = VllmConfig(num_gpu_blocks=1000, max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=4096)
    p = predict(cfg, 512, 256, shared_prefix_tokens=256)
    assert p.no_preemption_limit == (999 - 16) // (48 - 16)
    s = closed_loop(cfg, 512, 256, p.no_preemption_limit, shared_prefix_tokens=256, start="burst")
    assert s.preemptions_per_1k_steps == 0 and s.waiting_mean == 0


def test_shared_prefix_must_be_shorter_than_the_prompt():
    with pytest.raises(ConfigError, match="shared_prefix_tokens"):
        predict(LONG, 100, 10, shared_prefix_tokens=100)
    with pytest.raises(ConfigError, match="shared_prefix_tokens"):
        closed_loop(LONG, 100, 10, 2, shared_prefix_tokens=-1)
