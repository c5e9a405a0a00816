"""The event-driven fast path (`plain_steps` / `skip`) is exact: a closed loop that jumps over
plain decode stretches measures the very same numbers as one that calls step() every step —
both engines, every policy, sync and async, caching on and off, shared prefixes, and shapes
small enough that preemption (vLLM) and retraction (SGLang) happen."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvprobe.theory.schedsim import (
    SglangConfig,
    SimRequest,
    VllmConfig,
    closed_loop,
    make_scheduler,
    workload_prompt,
)


@st.composite
def vllm_case(draw):
    P = draw(st.integers(1, 120))
    O = draw(st.integers(1, 150))  # noqa: E741
    B = draw(st.sampled_from([1, 4, 16]))
    need = -(-(P + O) // B)
    cfg = VllmConfig(num_gpu_blocks=draw(st.integers(-(-P // B) + 2, 6 * need + 2)), block_size=B,
                     max_num_seqs=draw(st.integers(2, 24)), max_num_batched_tokens=draw(st.integers(24, 400)),
                     max_model_len=P + O + draw(st.integers(0, 5)), enable_prefix_caching=draw(st.booleans()),
                     enable_chunked_prefill=True, policy=draw(st.sampled_from(["vllm-0.33", "vllm-0.11"])),
                     async_scheduling=draw(st.booleans()), watermark=draw(st.sampled_from([0.0, 0.05])))
    return cfg, P, O


@st.composite
def sglang_case(draw):
    P = draw(st.integers(2, 120))
    O = draw(st.integers(1, 150))  # noqa: E741
    ps = draw(st.sampled_from([1, 4]))
    M = draw(st.integers(P + O + 2 * ps + 4, 6 * (P + O) + 40))
    cfg = SglangConfig(max_total_num_tokens=M, page_size=ps, max_running_requests=draw(st.integers(1, 24)),
                       chunked_prefill_size=draw(st.sampled_from([-1, 32, 64, 256])), max_prefill_tokens=512,
                       context_len=P + O + 8, disable_radix_cache=draw(st.booleans()),
                       policy=draw(st.sampled_from(["sglang-0.5.22", "sglang-0.5.21"])),
                       overlap=draw(st.booleans()))
    return cfg, P, O


def _both(cfg, P, O, users, K, start):  # noqa: E741
    kw = dict(shared_prefix_tokens=K, start=start, lifetimes=3, warmup_lifetimes=1, batches=3)
    return closed_loop(cfg, P, O, users, fast=True, **kw), closed_loop(cfg, P, O, users, fast=False, **kw)


@settings(max_examples=int(__import__("os").environ.get("KVPROBE_HYPOTHESIS_EXAMPLES", "80")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=vllm_case(), users=st.integers(1, 30), k=st.floats(0, 0.99), start=st.sampled_from(["ramp", "burst"]))
def test_vllm_fast_path_is_exact(case, users, k, start):
    cfg, P, O = case  # noqa: E741
    fast, slow = _both(cfg, P, O, users, int(k * P), start)
    assert fast == slow


@settings(max_examples=int(__import__("os").environ.get("KVPROBE_HYPOTHESIS_EXAMPLES", "80")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=sglang_case(), users=st.integers(1, 30), k=st.floats(0, 0.99), start=st.sampled_from(["ramp", "burst"]))
def test_sglang_fast_path_is_exact(case, users, k, start):
    cfg, P, O = case  # noqa: E741
    fast, slow = _both(cfg, P, O, users, int(k * P), start)
    assert fast == slow


def test_the_fast_path_jumps_and_preemption_still_happens():
    """The property above is not vacuous: the shapes it draws do skip, and do preempt."""
    cfg = VllmConfig(num_gpu_blocks=200, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024)
    sched = make_scheduler(cfg)
    for i in range(20):
        sched.add(SimRequest(f"r{i}", workload_prompt(i, 100), 400))
    jumped = stepped = 0
    while sched.has_work() and sched.stats.steps < 3000:
        k = sched.plain_steps(10_000)
        if k:
            sched.skip(k)
            jumped += k
        else:
            sched.step()
            stepped += 1
    assert jumped > stepped and sched.stats.preemptions_total > 0


def test_skip_leaves_the_scheduler_where_steps_would():
    for cfg in (VllmConfig(num_gpu_blocks=300, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024),
                VllmConfig(num_gpu_blocks=300, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024,
                           async_scheduling=True),
                SglangConfig(max_total_num_tokens=6000, context_len=2048),
                SglangConfig(max_total_num_tokens=6000, context_len=2048, page_size=4, overlap=False)):
        a, b = make_scheduler(cfg), make_scheduler(dataclasses.replace(cfg))
        for s in (a, b):
            for i in range(6):
                s.add(SimRequest(f"r{i}", workload_prompt(i, 100, 30), 300))
        for _ in range(5):
            a.step()
            b.step()
        k = a.plain_steps(1000)
        assert k > 10
        used = a.skip(k)
        expect = 0
        for _ in range(k):
            b.step()
            expect += b.stats.used_tokens
        assert used == expect
        a.sync()
        b.sync()
        assert [(r.output_len, r.num_computed_tokens) for r in a.run.reqs[: a.run.n]] == \
            [(r.output_len, r.num_computed_tokens) for r in b.run.reqs[: b.run.n]]
        assert a.stats == b.stats
        a.check_pool()
        b.check_pool()


@settings(max_examples=int(__import__("os").environ.get("KVPROBE_HYPOTHESIS_EXAMPLES", "80")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=vllm_case(), users=st.integers(1, 30), k=st.floats(0, 0.99))
def test_vllm_head_memo_changes_nothing(case, users, k):
    """A head that failed is not re-examined until free blocks grow or a key is cached: the loop
    measures the same with the memo off."""
    from kvprobe.theory.sched_vllm import VllmScheduler

    cfg, P, O = case  # noqa: E741
    kw = dict(shared_prefix_tokens=int(k * P), lifetimes=3, warmup_lifetimes=1, batches=3, fast=False)
    with_memo = closed_loop(cfg, P, O, users, **kw)
    VllmScheduler.memo = False
    try:
        from kvprobe.theory import schedsim

        schedsim._closed_loop.cache_clear()
        without = closed_loop(cfg, P, O, users, **kw)
    finally:
        VllmScheduler.memo = True
        schedsim._closed_loop.cache_clear()
    assert with_memo == without
