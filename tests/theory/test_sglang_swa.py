"""SGLang's hybrid sliding-window scheduler (sglang/swa/scheduler.py): worked numbers and invariants.

The step-by-step check against SGLang's own Scheduler is tests/theory/test_real_sglang.py (the
"swa: ..." shapes); here: the window rule on one request by hand, the pool invariants under random
configurations, and what is refused."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_fastpath import sglang_swa_case

from kvprobe.errors import ConfigError
from kvprobe.theory.schedsim import SglangConfig, SimRequest, make_scheduler, workload_prompt
from kvprobe.theory.sglang.swa.radix import SglangSwaRadixScheduler
from kvprobe.theory.sglang.swa.scheduler import SglangSwaScheduler

W = 127  # gpt-oss: sliding_window 128 - 1
CFG = SglangConfig(max_total_num_tokens=8000, disable_radix_cache=True, sliding_window_size=W, swa_pool_tokens=4000)


def _windows_held(cfg: SglangConfig, P: int, O: int) -> list[int]:  # noqa: N803, E741
    """The window pool's used slots after every step of one request alone."""
    sched = make_scheduler(cfg)
    sched.add(SimRequest("r", workload_prompt(0, P), O))
    held = []
    while sched.has_work():
        sched.step()
        sched.check_pool()
        held.append(sched.swa.used)
    return held


def test_one_request_holds_at_most_window_plus_interval_between_evictions():
    """P = 300, overlap on: the prefill takes 300 window slots; the second decode batch (its
    seqlen 301: 301 - 1 - 127 = 173 >= 0 + 128) frees the 173 below the window, leaving 128 + 1
    being decoded; from then on a request frees once 128 more tokens slid out (seqlen - 1 - 127 >=
    evicted + 128), so it holds between W + 2 (just freed: the window, the token at its edge and the
    one being written) and W + 129 slots (127 more slid out, the next step frees them)."""
    held = _windows_held(CFG, 300, 400)
    assert held[:4] == [300, 301, 302 - 173, 130]
    steady = held[3:-1]
    assert min(steady) == W + 2 and max(steady) == W + 129
    assert held[-1] == 0  # everything back when it finishes


def test_a_short_request_never_evicts():
    """seqlen - 1 - 127 stays below 128: P + O <= 256 tokens keep every window slot."""
    held = _windows_held(CFG, 100, 150)
    assert max(held) == 100 + 149 and held[-1] == 0


def test_admission_charges_the_window_estimate_not_the_prompt():
    """estimate_swa_kv_tokens (prefill_budget.py L25-56): a new request's window charge is
    max(P - W, 0) + min(P + max_new, W) + page. P = 300, O = 400: 173 + 127 + 1 = 301, so a pool
    of 301 admits nothing (check_prefill: needed < remaining) and one of 302 admits it."""
    sched = make_scheduler(dataclasses.replace(CFG, swa_pool_tokens=302))
    assert sched._swa_tokens(300, 400, None) == 301
    for size, runs in ((301, 0), (302, 1)):
        sched = make_scheduler(dataclasses.replace(CFG, swa_pool_tokens=size))
        sched.add(SimRequest("r", workload_prompt(0, 300), 400, ignore_eos=False))
        sched.step()
        assert sched.run.n == runs


def test_the_radix_cache_on_is_the_radix_scheduler_and_the_radix_off_one_refuses_it():
    on = dataclasses.replace(CFG, disable_radix_cache=False)
    assert isinstance(make_scheduler(on), SglangSwaRadixScheduler)
    with pytest.raises(ConfigError) as err:
        SglangSwaScheduler(on)
    assert err.value.key == "disable_radix_cache" and "SglangSwaRadixScheduler" in str(err.value)


def test_radix_on_a_prefill_keeps_one_window_locked_and_the_rest_evictable():
    """A prompt of 300 on SGLang's window 127 (pages of 1): 300 window slots while it is computed,
    then 127 locked in the tree + its first decode slot (SGLang's trace: 300, 128, 129, ...);
    pages of 16, a prompt of 250: 256, then 128 locked + the page in use (256, 144)."""
    for ps, P, first, second in ((1, 300, 300, 128), (16, 250, 256, 144)):  # noqa: N806
        sched = make_scheduler(dataclasses.replace(CFG, disable_radix_cache=False, page_size=ps))
        sched.add(SimRequest("a", list(range(1, P + 1)), 400, ignore_eos=True))
        seen = []
        for _ in range(3):
            sched.step()
            seen.append(sched.swa.used)
            sched.check_pool()
        assert seen[:2] == [first, second]


# Found by the search: a request retracted four times with 38 of its 42 tokens out comes back as a
# prefill of 40 tokens, which a window pool of 37 cannot hold (no chunking): it parks, nothing else does.
PARKS_AFTER_RETRACTION = (SglangConfig(max_total_num_tokens=167, max_running_requests=3, chunked_prefill_size=-1,
                                       max_prefill_tokens=512, context_len=52, disable_radix_cache=True,
                                       policy="sglang-0.5.21", overlap=False, sliding_window_size=4,
                                       swa_pool_tokens=37), 2, 42)

# Found by the search: the window budget leaves room for one token when a chunked request's last
# two prompt tokens come; the continuation is cut to that token, not rounded up to a page (as it
# was here, which joined the request running with 120 of its 118 prompt tokens computed).
CUT_MID_PAGE = (SglangConfig(max_total_num_tokens=426, page_size=4, max_running_requests=3, chunked_prefill_size=32,
                             max_prefill_tokens=512, context_len=147, policy="sglang-0.5.22", overlap=False,
                             sliding_window_size=53, swa_pool_tokens=297), 118, 21)


# Found by the search in a clean clone: u1, retracted, comes back needing 120 + 114 + 2 window slots of 234
# and parks for good at the queue's head; u6 (120 + 43) waits behind it, as in SGLang, whose FCFS pass
# stops at the first request that does not fit.
BEHIND_A_PARKED_HEAD = (SglangConfig(max_total_num_tokens=1507, page_size=1, max_running_requests=7,
                                     chunked_prefill_size=-1, max_prefill_tokens=512, context_len=256,
                                     policy="sglang-0.5.22", overlap=False, sliding_window_size=4,
                                     swa_pool_tokens=234), 120, 128)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=sglang_swa_case(), users=st.integers(1, 20), eos=st.booleans(), radix=st.booleans())
@example(case=PARKS_AFTER_RETRACTION, users=6, eos=False, radix=True)
@example(case=CUT_MID_PAGE, users=5, eos=False, radix=True)
@example(case=BEHIND_A_PARKED_HEAD, users=7, eos=False, radix=True)
def test_both_pools_account_every_slot(case, users, eos, radix):
    """Whatever runs, finishes, is chunked or retracted: each pool's used slots are exactly what
    the requests hold (check_pool), never more than its size, and all come back at the end. (A
    window pool that cannot hold a prompt parks its last chunk once the earlier chunks fill it:
    with overlap they are freed only from two chunks back. A request retracted mid-output comes back
    as a prefill of its prompt and its output so far: one the window pool cannot hold parks for good,
    as in SGLang, and what queues behind it waits: a pass stops at the first request that does not fit.)
    The radix cache on: what a request leaves in the tree is evictable, not used."""
    cfg, P, O = case  # noqa: E741
    cfg = dataclasses.replace(cfg, disable_radix_cache=not radix)
    sched = make_scheduler(cfg)
    for u in range(users):
        sched.add(SimRequest(f"u{u}", workload_prompt(u, P), O, ignore_eos=not eos, eos_after=max(1, O // 2)))
    for _ in range(50 * (P + O) * users):
        if not sched.has_work():
            break
        sched.step()
        sched.check_pool()
        assert 0 <= sched.swa.used <= cfg.swa_pool_tokens
    if cfg.swa_pool_tokens > P + 2 * cfg.page_size:  # else a prompt may park for good (as in SGLang)
        head = sched.waiting[0] if sched.waiting else None  # the FCFS pass tries it first
        assert sched.run.n == 0
        assert head is None or P + head.output_len + 2 * cfg.page_size > cfg.swa_pool_tokens, head
        assert sched.pool.used == sched.swa.used == 0


def test_the_usage_gauge_is_the_fuller_pool():
    """sglang:token_usage on a hybrid SWA pool: max(full, window) usage, 2 decimals
    (pool_stats_observer.py L84-100, L150-158). A 300-token prompt in a window pool of 400 reads
    0.75 while the full pool of 8,000 is at 4%."""
    sched = make_scheduler(dataclasses.replace(CFG, swa_pool_tokens=400))
    sched.add(SimRequest("r", workload_prompt(0, 300), 400))
    sched.step()
    assert (sched.pool.used, sched.swa.used) == (300, 300)
    assert sched.stats.usage == 0.75 and sched.stats.used_tokens == 300 and sched.stats.swa_used_tokens == 300
