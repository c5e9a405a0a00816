"""The step simulation reproduces the references' measured/derived numbers and never leaks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprobe.theory.schedsim import (
    SglangConfig,
    SimRequest,
    VllmConfig,
    closed_loop,
    make_scheduler,
)

REF = VllmConfig(num_gpu_blocks=1000, block_size=16, max_num_seqs=1024, max_num_batched_tokens=8192,
                 max_model_len=4096)
EX_A = SglangConfig(max_total_num_tokens=16384, context_len=8192)


def unique(i: int, n: int) -> list[int]:
    return [1000 + i] + [(i * 31 + k) % 30000 for k in range(1, n)]


# ---------------------------------------------------------------- vLLM (closed-loop steady states)


def test_vllm_below_no_preemption_limit_runs_everyone():
    s = closed_loop(REF, 512, 256, 20)
    assert 19.8 <= s.running_mean <= 20.0
    assert s.waiting_mean == 0 and s.preemptions_per_1k_steps == 0


def test_vllm_saturated_plateau_and_recurring_preemptions():
    s = closed_loop(REF, 512, 256, 32)
    assert 23.8 <= s.running_mean <= 24.6
    assert 7.2 <= s.waiting_mean <= 8.2
    assert s.preemptions_per_1k_steps > 20
    assert 0.96 <= s.usage_mean <= 0.99


def test_vllm_plateau_does_not_depend_on_users_once_saturated():
    assert closed_loop(REF, 512, 256, 64).running_mean == pytest.approx(
        closed_loop(REF, 512, 256, 32).running_mean, abs=0.3)


def test_vllm_second_shape():
    cfg = VllmConfig(num_gpu_blocks=2000, max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=4096)
    assert closed_loop(cfg, 1000, 100, 28).preemptions_per_1k_steps == 0
    s = closed_loop(cfg, 1000, 100, 80)
    assert 29.0 <= s.running_mean <= 29.8


def test_vllm_max_num_seqs_row():
    cfg = VllmConfig(num_gpu_blocks=1000, max_num_seqs=16, max_num_batched_tokens=8192, max_model_len=4096)
    s = closed_loop(cfg, 512, 256, 20)
    assert s.running_max == 16 and 15.8 <= s.running_mean <= 16
    assert s.waiting_mean == pytest.approx(4, abs=0.1) and s.preemptions_per_1k_steps == 0


def test_vllm_old_policy_admits_on_first_chunk():
    # run on 0.33.0: P=3000, O=64, budget 2048, G=2000 -> preemptions only without full-ISL
    # (--no-scheduler-reserve-full-isl)
    kw = dict(num_gpu_blocks=2000, max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=8192)
    new = closed_loop(VllmConfig(**kw), 3000, 64, 24)
    old = closed_loop(VllmConfig(**kw, policy="vllm-0.11"), 3000, 64, 24)
    assert new.preemptions_per_1k_steps == 0
    assert old.preemptions_per_1k_steps > 0


def test_vllm_exact_output_length_and_block_accounting():
    sched = make_scheduler(VllmConfig(num_gpu_blocks=100, enable_prefix_caching=False))
    sched.add(SimRequest("a", unique(0, 40), 10))
    tokens, steps = [], 0
    while sched.has_work():
        r = sched.step()
        steps += 1
        tokens += [t for req, t in r.emitted]
        if steps == 1:  # prefill of 40 tokens: 3 blocks
            assert r.prefill_tokens == 40 and sched.pool.num_free == 99 - 3
    assert len(tokens) == 10 and steps == 10
    assert sched.pool.num_free == 99


def test_vllm_eos_and_max_model_len_stop():
    sched = make_scheduler(VllmConfig(num_gpu_blocks=100, max_model_len=50))
    a = SimRequest("a", unique(1, 20), 100, ignore_eos=False, eos_after=5)
    b = SimRequest("b", unique(2, 45), 100)
    sched.add(a)
    sched.add(b)
    while sched.has_work():
        sched.step()
    assert (a.output_len, a.finish_reason) == (5, "stop")
    assert (b.output_len, b.finish_reason) == (5, "length")  # 45 + 5 = max_model_len


def test_prefix_caching_shared_prompts_use_fewer_blocks():
    prompt = unique(3, 160)  # 10 full blocks
    used = {}
    for shared in (True, False):
        sched = make_scheduler(VllmConfig(num_gpu_blocks=400))
        for i in range(4):
            sched.add(SimRequest(f"r{i}", prompt if shared else unique(10 + i, 160), 8))
        sched.step()
        used[shared] = sched.pool.usable - sched.pool.num_free
    assert used[False] == 4 * 10
    # the hit is capped at 159 tokens = 9 blocks: 9 shared, plus block 10 of each request
    assert used[True] == 9 + 4 * 1
    assert sched.stats.prefix_hits_total == 0


def test_prefix_hit_on_evictable_block_still_consumes_a_free_block():
    prompt = unique(4, 64)  # 4 full blocks
    sched = make_scheduler(VllmConfig(num_gpu_blocks=20))
    sched.add(SimRequest("first", prompt, 1))
    sched.step()  # finishes after one token; its blocks are cached, ref_cnt 0, in the free queue
    assert sched.pool.num_free == 19 and sched.pool.lru_blocks == 4 and len(sched.pool.free_keys) == 4
    sched.add(SimRequest("second", prompt, 4))
    sched.step()
    # hit capped at num_tokens-1 = 63 tokens -> 3 blocks; each hit block leaves the free queue
    assert sched.stats.prefix_hits_total == 48
    assert sched.pool.num_free == 19 - 4


def test_vllm_abort_frees_everything():
    sched = make_scheduler(VllmConfig(num_gpu_blocks=60, max_num_batched_tokens=256))
    for i in range(10):
        sched.add(SimRequest(f"r{i}", unique(i, 100), 200))
    for _ in range(30):
        sched.step()
    assert sched.stats.running > 0 and sched.stats.waiting > 0
    for i in range(10):
        sched.abort(f"r{i}")
    assert not sched.has_work()
    assert sched.pool.num_free == sched.pool.usable and sched.stats.usage == 0


# ---------------------------------------------------------------- SGLang (closed-loop steady states)


def test_sglang_example_a_cold_start_16_then_5():
    sched = make_scheduler(EX_A)
    for i in range(30):
        sched.add(SimRequest(f"r{i}", unique(i, 512), 256))
    sched.step()
    assert sched.stats.running == 16  # chunked_prefill_size 8192 / 512
    sched.step()
    assert sched.stats.running == 21 and sched.batch_full


def test_sglang_example_a_steady_state():
    s = closed_loop(EX_A, 512, 256, 64)
    assert s.running_max == 21 and s.running_mean > 20.5
    assert s.preemptions_per_1k_steps == 0


def test_sglang_example_b_long_output():
    s = closed_loop(EX_A, 512, 4096, 16, lifetimes=3, start="burst")
    assert s.running_max == 3 and s.preemptions_per_1k_steps == 0


def test_sglang_0521_drifts_above_the_reservation_limit_with_retractions():
    cfg = SglangConfig(max_total_num_tokens=16384, context_len=8192, policy="sglang-0.5.21")
    s = closed_loop(cfg, 512, 256, 64, lifetimes=20)
    assert s.running_mean > 21.2
    assert s.preemptions_per_1k_steps > 0


def test_sglang_token_usage_rounded_and_evictable_counts_as_free():
    sched = make_scheduler(EX_A)
    sched.add(SimRequest("a", unique(5, 300), 4))
    while sched.has_work():
        sched.step()
    assert sched.pool.evictable == 303 and sched.stats.usage == 0.0  # P+O-1 tokens cached
    sched.add(SimRequest("b", unique(6, 100), 4))
    sched.step()
    assert sched.stats.usage == round(100 / 16384, 2)


def test_sglang_abort_frees_everything():
    sched = make_scheduler(SglangConfig(max_total_num_tokens=4000, chunked_prefill_size=256))
    for i in range(8):
        sched.add(SimRequest(f"r{i}", unique(i, 600), 400))
    for _ in range(20):
        sched.step()
    for i in range(8):
        sched.abort(f"r{i}")
    assert not sched.has_work()
    assert sched.pool.used == 0


# ---------------------------------------------------------------- no leaks, any arrival/abort order

OPS = st.lists(st.tuples(st.sampled_from(["add", "add_shared", "abort", "step"]),
                         st.integers(0, 30), st.integers(1, 200), st.integers(1, 80)),
               min_size=1, max_size=60)


def _drive(sched, ops):
    live = []
    for n, (op, pick, plen, olen) in enumerate(ops):
        if op.startswith("add"):
            prompt = unique(0, plen) if op == "add_shared" else unique(n, plen)
            req = SimRequest(f"q{n}", prompt, olen, ignore_eos=pick % 3 != 0, eos_after=pick % 7 + 1)
            try:
                sched.add(req)
            except ValueError:
                continue
            live.append(req.rid)
        elif op == "abort" and live:
            sched.abort(live.pop(pick % len(live)))
        else:
            for _ in range(pick):
                sched.step()
        sched.check_pool()
    for _ in range(5000):
        if not sched.has_work():
            break
        sched.step()
        sched.check_pool()
    assert not sched.has_work()


@settings(max_examples=60, deadline=None)
@given(ops=OPS, caching=st.booleans(), old=st.booleans())
def test_vllm_pool_never_leaks(ops, caching, old):
    sched = make_scheduler(VllmConfig(num_gpu_blocks=40, max_num_seqs=8, max_num_batched_tokens=64,
                                      max_model_len=400, enable_prefix_caching=caching,
                                      policy="vllm-0.11" if old else "vllm-0.33"))
    _drive(sched, ops)
    assert sched.pool.num_free == sched.pool.usable and not sched.pool.refs


@settings(max_examples=60, deadline=None)
@given(ops=OPS, radix=st.booleans(), old=st.booleans(), overlap=st.booleans(), page=st.sampled_from([1, 4]))
def test_sglang_pool_never_leaks(ops, radix, old, overlap, page):
    sched = make_scheduler(SglangConfig(max_total_num_tokens=700, page_size=page, max_running_requests=8,
                                        chunked_prefill_size=128, context_len=400,
                                        disable_radix_cache=not radix, overlap=overlap,
                                        policy="sglang-0.5.21" if old else "sglang-0.5.22"))
    _drive(sched, ops)
    assert sched.pool.used == 0
