"""The event-driven fast path (`plain_steps` / `skip`) is exact: a closed loop that jumps over
plain decode stretches measures the very same numbers as one that calls step() every step —
both engines, every policy, sync and async, caching on and off, shared prefixes, and shapes
small enough that preemption (vLLM) and retraction (SGLang) happen."""

from __future__ import annotations

import dataclasses

import pytest
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
from kvprobe.theory.vllm.hybrid.kv_cache_manager import KVGroup


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
def vllm_hybrid_case(draw):
    """vLLM with the KV cache groups of a hybrid model: a window, chunk or Mamba group beside a
    full one (or windows alone), copies as Gemma 3's window groups have."""
    cfg, P, O = draw(vllm_case())  # noqa: E741
    kind = draw(st.sampled_from(["sliding", "chunked", "mamba", "sliding-only"]))
    copies = draw(st.integers(1, 3))
    window = draw(st.integers(1, 200))
    if kind == "mamba":
        other = KVGroup("mamba", copies=copies, block_size=0 if cfg.enable_prefix_caching else cfg.max_model_len)
    else:
        other = KVGroup(kind.removesuffix("-only"), copies=copies, window=window)
    groups = (other,) if kind == "sliding-only" else (other, KVGroup("full"))
    cfg = dataclasses.replace(cfg, groups=groups, policy="vllm-0.33")
    # vLLM refuses to start unless one request of max_model_len fits in every group at once
    # (_check_enough_kv_cache_memory, kv_cache_utils.py L50-87): at least that, plus some slack
    fits = 1 + make_scheduler(cfg).kvm.request_blocks
    blocks = fits + draw(st.integers(0, 3 * fits))
    return dataclasses.replace(cfg, num_gpu_blocks=blocks), P, O


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


@st.composite
def sglang_swa_case(draw):
    """A hybrid sliding-window config (radix off): a window pool at least window + a page + 1."""
    cfg, P, O = draw(sglang_case())  # noqa: E741
    W = draw(st.integers(4, 60))  # noqa: N806
    swa = draw(st.integers(W + 2 * cfg.page_size + 1, 4 * (W + 128) + 2 * P))
    return dataclasses.replace(cfg, disable_radix_cache=True, sliding_window_size=W, swa_pool_tokens=swa), P, O


def _both(cfg, P, O, users, K, start):  # noqa: E741
    kw = dict(shared_prefix_tokens=K, start=start, lifetimes=3, warmup_lifetimes=1, batches=3)
    return closed_loop(cfg, P, O, users, fast=True, **kw), closed_loop(cfg, P, O, users, fast=False, **kw)


@settings(max_examples=int(__import__("os").environ.get("KVPROBE_HYPOTHESIS_EXAMPLES", "80")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=vllm_case(), users=st.integers(1, 30), k=st.floats(0, 0.99), start=st.sampled_from(["ramp", "burst"]))
def test_vllm_fast_path_is_exact(case, users, k, start):
    cfg, P, O = case  # noqa: E741
    fast, slow = _both(cfg, P, O, users, int(k * P), start)
    assert fast == slow


@settings(max_examples=int(__import__("os").environ.get("KVPROBE_HYPOTHESIS_EXAMPLES", "80")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=vllm_hybrid_case(), users=st.integers(1, 30), start=st.sampled_from(["ramp", "burst"]))
def test_vllm_hybrid_fast_path_is_exact(case, users, start):
    """Hybrid pools have no closed-form stretches: the fast path declines (`jump` finds none) and
    closed_loop steps, with the very same results."""
    cfg, P, O = case  # noqa: E741
    fast, slow = _both(cfg, P, O, users, 0, start)
    assert fast == slow


@settings(max_examples=int(__import__("os").environ.get("KVPROBE_HYPOTHESIS_EXAMPLES", "80")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=sglang_case(), users=st.integers(1, 30), k=st.floats(0, 0.99), start=st.sampled_from(["ramp", "burst"]))
def test_sglang_fast_path_is_exact(case, users, k, start):
    cfg, P, O = case  # noqa: E741
    fast, slow = _both(cfg, P, O, users, int(k * P), start)
    assert fast == slow


@settings(max_examples=int(__import__("os").environ.get("KVPROBE_HYPOTHESIS_EXAMPLES", "80")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=sglang_swa_case(), users=st.integers(1, 30), start=st.sampled_from(["ramp", "burst"]))
def test_sglang_hybrid_swa_fast_path_is_exact(case, users, start):
    """SGLang's window pool has no closed-form stretches (windows are freed every 128 tokens): the
    fast path declines and closed_loop steps, with the very same results."""
    cfg, P, O = case  # noqa: E741
    fast, slow = _both(cfg, P, O, users, 0, start)
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
    from kvprobe.theory.vllm.scheduler import VllmScheduler

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


# ---------------------------------------------------------------- the closed forms and the jumps


@settings(max_examples=300, deadline=None)
@given(B=st.sampled_from([1, 2, 3, 16, 64]), tokens=st.lists(st.integers(0, 300), max_size=12),
       free=st.integers(0, 100), k=st.integers(-2, 200), shift=st.integers(0, 100))
def test_phases_closed_forms_equal_counting(B, tokens, free, k, shift):
    """Blocks taken after s steps, their sum, and the steps that fit, against counting them."""
    import numpy as np

    from kvprobe.theory.sim.pools import FullAttention, Phases

    t = np.array(tokens, np.int64)
    fp = FullAttention(B)
    taken = [int((fp.blocks(t + s) - fp.blocks(t)).sum()) for s in range(max(k, 0) + 1)]
    phases = fp.phases(t)
    assert [phases.allocs(s) for s in range(len(taken))] == taken
    assert phases.allocs_sum(max(k, 0)) == sum(taken[1:])
    fits = max([s for s in range(len(taken)) if taken[s] <= free], default=0)
    assert fp.steps_within(t, free, k) == (max(k, 0) if k <= 0 else fits)
    assert Phases.of_residues(np.bincount(t % B, minlength=B).tolist(), shift, len(t)).c == fp.phases(t + shift).c


def test_jumps_cascade_through_preemptions_exactly():
    """The vLLM fast path's cascades (stretches and the steps where blocks run out) do run, preempt,
    and leave every statistic as stepping does; the long-output shape is the one that needs them."""
    from kvprobe.theory.vllm.scheduler import VllmScheduler

    cfg = VllmConfig(num_gpu_blocks=1200, max_num_seqs=1024, max_num_batched_tokens=2048, max_model_len=8192,
                     async_scheduling=True)
    calls = {"preempting": 0}
    original = VllmScheduler._preempting_step

    def counting(self, *args):
        calls["preempting"] += 1
        return original(self, *args)

    VllmScheduler._preempting_step = counting
    try:
        fast = closed_loop(cfg, 300, 3000, 24, lifetimes=3, warmup_lifetimes=1, batches=3, fast=True)
    finally:
        VllmScheduler._preempting_step = original
    slow = closed_loop(cfg, 300, 3000, 24, lifetimes=3, warmup_lifetimes=1, batches=3, fast=False)
    assert calls["preempting"] > 50 and fast.preemptions_per_1k_steps > 0
    assert fast == slow


def test_a_resumed_request_hits_its_own_blocks_kept_as_one_run():
    """vLLM hashes output blocks too (only their request can hit them): a preempted request resumes on
    its prompt blocks and on its output blocks, which the pool keeps as one run."""
    sched = make_scheduler(VllmConfig(num_gpu_blocks=61, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                      max_model_len=400))
    sched.add(SimRequest("a", workload_prompt(0, 16), 200))
    sched.add(SimRequest("b", workload_prompt(1, 16), 200))
    hits = []
    while sched.has_work() and not hits:
        before = sched.stats.prefix_hits_total
        sched.step()
        sched.check_pool()
        if sched.stats.prefix_hits_total > before:
            hits.append(sched.stats.prefix_hits_total - before)
    b = sched.requests["b"]
    assert b.num_preemptions == 1 and hits and hits[0] > 16  # the prompt's 4 blocks and output blocks


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_default_window_ends_once_the_steady_state_stops_moving(engine):
    cfg = (VllmConfig(num_gpu_blocks=4000, max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=4096)
           if engine == "vllm" else SglangConfig(max_total_num_tokens=30000, context_len=8192))
    auto = closed_loop(cfg, 700, 300, 20)  # below every limit: 20 run from the start (less a finishing one)
    assert auto.stopped_early and auto.running_sem < 0.01 and auto.lifetimes >= 2
    full = closed_loop(cfg, 700, 300, 20, sem_stop=0)
    assert not full.stopped_early and full.steps > auto.steps
    assert abs(full.running_mean - auto.running_mean) < 0.01
    fixed = closed_loop(cfg, 700, 300, 20, lifetimes=3, batches=4)  # explicit lifetimes: the full window
    assert not fixed.stopped_early and fixed.lifetimes >= 3
