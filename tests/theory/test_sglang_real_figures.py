"""Figures SGLang 0.5.23's own Scheduler produced (tests/theory/real/sglang_driver.py, step by step),
checked here without it, one per rule the comparison taught the simulation (kvprobe/theory/
sglang/scheduler.py cites the engine's lines). Each row is (running, waiting, used tokens,
retractions, new_token_ratio) after that step of a closed loop."""

from __future__ import annotations

import dataclasses

from kvprobe.theory.schedsim import (
    SglangConfig,
    SimRequest,
    arrival_steps,
    make_scheduler,
    request_lifetime,
    workload_prompt,
)

BASE = SglangConfig(max_total_num_tokens=16384, context_len=8192)


def rows(cfg: SglangConfig, P, O, K, users, start, ignore_eos, steps, eos_after=None) -> list[list]:  # noqa: E741
    """The driver's closed loop: arrivals as closed_loop makes them, finished users resubmit."""
    arrivals = arrival_steps(request_lifetime(cfg, P, O), users, start)
    sched, count, out, nxt = make_scheduler(cfg), 0, [], 0
    for t in range(steps):
        while nxt < users and arrivals[nxt] <= t:
            sched.add(SimRequest(f"u{count}", workload_prompt(count, P, K), O, ignore_eos=ignore_eos,
                                 eos_after=eos_after))
            count, nxt = count + 1, nxt + 1
        result = sched.step()
        out.append([sched.run.n + (sched.chunked is not None), len(sched.waiting), sched.pool.used,
                    sched.stats.retracted_total, round(sched.ratio, 9)])
        for req in result.finished:
            sched.add(SimRequest(f"u{count}", workload_prompt(count, P, K), O, ignore_eos=ignore_eos,
                                 eos_after=eos_after))
            count += 1
            assert req.output_len == (eos_after or O)
    return out


def test_prompts_enter_the_tree_with_their_batch_result_and_the_latch_of_an_empty_batch_is_lost():
    # 40 users at once, a 300-token system prompt, no overlap, EOS as output 150
    r = rows(dataclasses.replace(BASE, overlap=False), 512, 400, 300, 40, "burst", False, 756, eos_after=150)
    # step 0 admits 16 = 8,192 / 512: candidates of one pass do not match each other's prompts;
    # step 1 matches the 300 shared tokens the first batch checkpointed
    assert r[0] == [16, 24, 3692, 0, 0.7] and r[1] == [29, 11, 6448, 0, 0.7]
    # the cohort ends at step 150; the next pass's NO_TOKEN latch was set on an empty running batch,
    # so step 152 admits 7 more instead of decoding
    assert r[150:153] == [[0, 11, 0, 0, 0.550503333], [26, 14, 5812, 0, 0.550503333],
                          [33, 7, 7296, 0, 0.550503333]]
    # everything finished at step 754 but the users resubmit: not idle, new_token_ratio not reset
    assert r[754] == [0, 0, 0, 0, 0.098] and r[755] == [26, 14, 5812, 0, 0.098]


def test_retraction_drops_the_token_in_flight_and_skips_decode_for_one_finishing():
    r = rows(BASE, 512, 256, 0, 40, "ramp", False, 2000)  # no ignore_eos: reserved by new_token_ratio
    # the pool is full at step 277; a request finishing in flight frees it instead of a retraction
    assert r[277:279] == [[23, 17, 16376, 0, 0.44415], [22, 17, 15609, 0, 0.44415]]
    # retracted requests recompute prompt + the outputs processed, not the one in flight
    assert r[640] == [22, 18, 13217, 3, 0.797865371]
    assert r[1999] == [25, 15, 14330, 5, 0.284212592]
