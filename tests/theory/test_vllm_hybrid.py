"""The hybrid vLLM scheduler (vllm/hybrid/scheduler.py over vllm/hybrid/kv_cache_manager.py): the rules of each
group kind on small cases worked by hand from vLLM 0.33.0's source, and, as a property, that its explicit
block pool run with one full-attention group is the count-based full-attention scheduler."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvprobe.theory.schedsim import SimRequest, VllmConfig, make_scheduler, workload_prompt
from kvprobe.theory.vllm.hybrid.kv_cache_manager import KVGroup
from kvprobe.theory.vllm.hybrid.scheduler import HybridVllmScheduler
from kvprobe.theory.vllm.scheduler import VllmScheduler

EXAMPLES = int(os.environ.get("KVPROBE_HYPOTHESIS_EXAMPLES", "80"))
FULL = KVGroup("full")


def held(sched, rid: str) -> list[int]:
    """Live blocks of one request in each group copy."""
    return [m.held(rid) for m in sched.kvm.managers]


def decode_alone(cfg: VllmConfig, P: int, O: int, rid: str = "r"):  # noqa: E741
    sched = make_scheduler(cfg)
    sched.add(SimRequest(rid, workload_prompt(0, P), O))
    return sched


def test_a_window_group_frees_what_left_the_window():
    """SlidingWindowManager.get_num_skipped_tokens: after c computed tokens the first c - W + 1
    are out of the window; their whole blocks are freed before the next allocation (sync: on
    the processed basis, which is all computed tokens)."""
    cfg = VllmConfig(num_gpu_blocks=100, block_size=16, max_model_len=2048,
                     groups=(KVGroup("sliding", window=128), FULL))
    sched = decode_alone(cfg, 300, 500)
    sched.step()  # the prompt: 19 blocks in both groups (nothing skipped yet at allocation)
    assert held(sched, "r") == [19, 19]
    for _ in range(100):
        sched.step()
    # the last step computed token 399: both tables are cdiv(400, 16) = 25 long, and before the
    # allocation (399 - 128 + 1) // 16 = 17 window blocks had left the window
    assert sched.run.row(0)["comp"] == 400 and held(sched, "r") == [25 - 17, 25]
    sched.check_pool()
    assert sched.stats.usage == pytest.approx((8 + 25) / 99)  # one pool: every group's blocks over num_gpu_blocks - 1


def test_admission_is_capped_per_window_group():
    """The full-sequence check counts a window group's blocks up to max_admission_blocks_per_request
    = cdiv(min(W - 1 + in-flight tokens, max_model_len), B) + 1 (kv_cache_interface.py L917-944):
    with W = 64, one batch of 256 tokens, a 2,000-token prompt needs 21 window blocks, not 125."""
    cap = -(-(64 - 1 + 256) // 16) + 1
    assert cap == 21
    cfg = VllmConfig(num_gpu_blocks=1 + 125 + cap, block_size=16, max_num_seqs=4, max_num_batched_tokens=256,
                     max_model_len=4096, groups=(KVGroup("sliding", window=64), FULL))
    sched = decode_alone(cfg, 2000, 10)
    sched.step()
    assert sched.stats.running == 1  # fits exactly: 125 full + 21 window blocks
    smaller = decode_alone(dataclasses.replace(cfg, num_gpu_blocks=cfg.num_gpu_blocks - 1), 2000, 10)
    smaller.step()
    assert smaller.stats.running == 0 and smaller.stats.waiting == 1


def test_before_0_20_the_full_sequence_check_charges_a_window_group_the_whole_prompt():
    """V4 (theory/vllm/releases.py WINDOW_CAP_FROM): 0.19.1's full-sequence gate calls the window
    manager's get_num_blocks_to_allocate as is, cdiv(P, B) (single_type_kv_cache_manager.py L105 in
    0.18.1, no cap): the pool that admits the 2,000-token prompt above on 0.20.0 (125 + 21 blocks)
    admits nothing on 0.19.1, which needs 125 + 125."""
    cfg = VllmConfig(num_gpu_blocks=1 + 125 + 21, block_size=16, max_num_seqs=4, max_num_batched_tokens=256,
                     max_model_len=4096, groups=(KVGroup("sliding", window=64), FULL))
    old = decode_alone(dataclasses.replace(cfg, window_admission_cap=False), 2000, 10)
    old.step()
    assert old.stats.running == 0 and old.stats.waiting == 1
    whole = decode_alone(dataclasses.replace(cfg, window_admission_cap=False, num_gpu_blocks=1 + 125 + 125), 2000, 10)
    whole.step()
    assert whole.stats.running == 1


def test_before_0_26_one_batch_counts_in_flight_and_the_window_frees_on_scheduled_tokens():
    """V5 (WINDOW_IN_FLIGHT_FROM): with async scheduling 0.26.0 frees what left the window on the
    processed tokens, num_computed - num_in_flight (kv_cache_manager.py L443-445), so a prefilling request
    keeps the previous chunk's window blocks one step longer; 0.25.1 frees on num_computed (L404-407), and
    its cap and a request's most blocks count one batch: cdiv(127 + 512, 16) + 1 = 41, not 73."""
    cfg = VllmConfig(num_gpu_blocks=400, block_size=16, max_num_seqs=4, max_num_batched_tokens=512,
                     max_model_len=4096, async_scheduling=True, groups=(KVGroup("sliding", window=128), FULL))
    new, old = (decode_alone(dataclasses.replace(cfg, window_in_flight=f), 1000, 50) for f in (True, False))
    assert [m.max_blocks for m in new.kvm.managers] == [73, 256]
    assert [m.max_blocks for m in old.kvm.managers] == [41, 256]
    for sched in (new, old):
        sched.step()
        sched.step()  # the second chunk: tokens 512..1023 scheduled, the first chunk still in flight
    # 0.25.1 freed the first chunk's window blocks at the second allocation ((512 - 127) // 16 = 24 of 32);
    # 0.26.0 had processed none of it then (512 in flight)
    assert held(old, "r") == [63 - 24, 63] and held(new, "r") == [63, 63]
    new.check_pool()
    old.check_pool()


def test_a_chunk_group_frees_a_whole_chunk_at_its_boundary():
    cfg = VllmConfig(num_gpu_blocks=200, block_size=16, max_model_len=4096,
                     groups=(KVGroup("chunked", window=256), FULL))
    sched = decode_alone(cfg, 250, 100)
    sched.step()
    assert held(sched, "r") == [16, 16]
    for _ in range(6):  # decodes up to token 255: the chunk 0..255 is still the current one
        sched.step()
    assert sched.run.row(0)["comp"] == 256 and held(sched, "r") == [16, 16]
    sched.step()  # computing token 256: the chunk behind is skipped, its 16 blocks freed first
    assert held(sched, "r") == [1, 17]


def test_a_mamba_group_holds_one_state_block_two_across_a_boundary():
    """MambaManager "align": one state block per request; crossing a block boundary allocates the
    next before the previous one is freed at the following step."""
    cfg = VllmConfig(num_gpu_blocks=50, block_size=64, max_model_len=4096, groups=(KVGroup("mamba"), FULL))
    sched = decode_alone(cfg, 100, 100)
    counts = []
    for _ in range(40):
        sched.step()
        counts.append(held(sched, "r")[0])
    assert set(counts) == {1, 2} and counts.count(2) < 4
    none = decode_alone(VllmConfig(num_gpu_blocks=50, block_size=64, max_model_len=4096, enable_prefix_caching=False,
                                   groups=(KVGroup("mamba", block_size=4096), FULL)), 100, 100)
    for _ in range(40):
        none.step()
        assert held(none, "r")[0] == 1  # "none" mode: one block of max_model_len tokens


@st.composite
def vllm_case(draw):
    P = draw(st.integers(1, 120))
    O = draw(st.integers(1, 150))  # noqa: E741
    B = draw(st.sampled_from([1, 4, 16]))
    need = -(-(P + O) // B)
    seqs = draw(st.integers(2, 24))
    cfg = VllmConfig(num_gpu_blocks=draw(st.integers(-(-P // B) + 2, 6 * need + 2)), block_size=B,
                     max_num_seqs=seqs, max_num_batched_tokens=draw(st.integers(max(24, seqs), 400)),
                     max_model_len=P + O + draw(st.integers(0, 5)), enable_prefix_caching=draw(st.booleans()),
                     watermark=draw(st.sampled_from([0.0, 0.05])))
    return cfg, P, O


def _trace(sched, P, O, users, K, steps):  # noqa: E741
    count, out = 0, []
    for _ in range(users):
        sched.add(SimRequest(f"u{count}", workload_prompt(count, P, K), O))
        count += 1
    for _ in range(steps):
        result = sched.step()
        s = sched.stats
        out.append((s.running, s.waiting, s.used_tokens, s.preemptions_total, len(result.finished)))
        for _ in result.finished:
            sched.add(SimRequest(f"u{count}", workload_prompt(count, P, K), O))
            count += 1
    sched.check_pool()
    return out


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=vllm_case(), users=st.integers(1, 30), k=st.floats(0, 0.99))
def test_one_full_group_through_the_explicit_pool_is_the_count_based_scheduler(case, users, k):
    """Two implementations of vLLM's full-attention KV cache — counts and runs (vllm/block_pool.py) and
    explicit blocks (vllm/hybrid/kv_cache_manager.py) — schedule every step alike, synchronous scheduling: running,
    waiting, used blocks, preemptions, finishes. (In async mode with prefix caching the two can
    part in pools of a few blocks; vLLM's own scheduler sides with the explicit pool there:
    tests/theory/test_real_vllm_hybrid.py::test_the_explicit_pool_where_the_count_model_parts.)"""
    cfg, P, O = case  # noqa: E741
    K = int(k * P)
    counts = _trace(VllmScheduler(cfg), P, O, users, K, 300)
    explicit = _trace(HybridVllmScheduler(dataclasses.replace(cfg, groups=(FULL,))), P, O, users, K, 300)
    assert counts == explicit


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=__import__("tests.theory.test_fastpath", fromlist=["vllm_hybrid_case"]).vllm_hybrid_case(),
       users=st.integers(1, 20), asyn=st.booleans())
def test_hybrid_pools_never_leak_and_every_request_completes(case, users, asyn):
    """Whatever the groups: after every step the blocks out of the free queue are exactly the ones
    running requests hold, and each request ends with its O tokens."""
    cfg, P, O = case  # noqa: E741
    sched = make_scheduler(dataclasses.replace(cfg, async_scheduling=asyn))
    # async scheduling keeps two batches in flight, so a window group's cap can grow past the pool
    # the case was sized for; vLLM refuses to start there (kv_cache_utils.py L50-87): a request the
    # pool cannot admit would wait forever
    assume(cfg.num_gpu_blocks > sched.kvm.request_blocks)
    reqs = [SimRequest(f"u{i}", workload_prompt(i, P), O) for i in range(users)]
    for r in reqs:
        sched.add(r)
    steps = 0
    while sched.has_work():
        sched.step()
        sched.check_pool()
        steps += 1
        assert steps < 200 * (P + O) * users, "no progress"
    assert all(r.status == "finished" and r.output_len == O for r in reqs)
    assert sched.kvm.pool.num_free == cfg.num_gpu_blocks - 1
