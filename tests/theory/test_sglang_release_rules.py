"""SGLang's two older scheduler-loop rules on small histories (kvprobe/theory/sglang/releases.py).

(a) Up to 0.5.22 a finished request stays in the running batch until the next step that decodes:
    `update_running_batch` filters it (0.5.19 scheduler.py L3869-3875) and only then is the
    batch-full latch released (L3943-3944); its place counts against max_running_requests
    (get_num_allocatable_reqs) and its reserve in PrefillAdder (schedule_policy.py L530-536) until
    then. 0.5.23 filters the running batch every step before deciding on a prefill (L3963-3968).
(b) Up to 0.5.21 the overlap scheduler decodes a request whose in-flight token is its last; 0.5.22
    leaves it out (`_reqs_finishing_inflight`, 0.5.22 scheduler.py L4320-4343).
The step-by-step check against those releases' own Scheduler is tests/theory/matrix_real_sglang_releases.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvprobe.theory.schedsim import SglangConfig, SimRequest, make_scheduler
from kvprobe.theory.sglang.releases import scheduler_rule_text, scheduler_rules


def history(cfg: SglangConfig, users: int, P: int, O: int, steps: int, eos_after=None) -> list[dict]:  # noqa: N803, E741
    """Per step: running, waiting, decoded, prefilled, finished; every user sends once at step 0."""
    sched, rows = make_scheduler(cfg), []
    for u in range(users):
        sched.add(SimRequest(f"u{u}", [50000 + u] + [13] * (P - 1), O, ignore_eos=eos_after is None,
                             eos_after=eos_after))
    for _ in range(steps):
        r = sched.step()
        rows.append({"running": sched.run.n, "waiting": len(sched.waiting), "decoded": r.decode_seqs,
                     "prefilled": r.prefill_tokens, "finished": len(r.finished)})
    return rows


@pytest.mark.parametrize("version,leave_at_decode,decode_finishing", [
    ("0.5.14", True, True), ("0.5.19", True, True), ("0.5.21", True, True),
    ("0.5.22", True, False), ("0.5.23", False, False)])
def test_the_release_bounds(version, leave_at_decode, decode_finishing):
    assert scheduler_rules(version) == {"finished_leave_at_decode": leave_at_decode,
                                        "decode_finishing_inflight": decode_finishing}


TWO_SLOTS = SglangConfig(max_total_num_tokens=10000, context_len=2048, max_running_requests=2)


def test_a_finished_request_holds_its_place_until_the_next_decode_step():
    """Two slots, three users, overlap off: u0 and u1 finish at step 2. 0.5.23 admits u2 at step 3;
    0.5.22's batch still holds the two finished requests at step 3 (no room: get_num_allocatable_reqs),
    that step's update_running_batch filters them, and u2 is admitted at step 4."""
    cfg = dataclasses.replace(TWO_SLOTS, overlap=False)
    new = history(cfg, 3, 10, 3, 8)
    old = history(dataclasses.replace(cfg, **scheduler_rules("0.5.22")), 3, 10, 3, 8)
    assert new[2]["finished"] == old[2]["finished"] == 2
    assert new[3]["prefilled"] == 10 and new[3]["waiting"] == 0
    assert old[3]["prefilled"] == 0 and old[3]["waiting"] == 1 and old[3]["decoded"] == 0
    assert old[4]["prefilled"] == 10


def test_a_request_left_out_of_the_decode_does_not_stay():
    """With overlap, 0.5.22's decode leaves out the requests whose last token is in flight, and so
    filters them out of the batch before they finish (`_reqs_finishing_inflight`, L4339-4340): u2
    is admitted in the step after the finish, as on 0.5.23. On 0.5.21 they were decoded once more,
    finish in the batch and hold their places to the next decode step: a step later."""
    admitted = {}
    for version in ("0.5.21", "0.5.22", "0.5.23"):
        rows = history(dataclasses.replace(TWO_SLOTS, **scheduler_rules(version)), 3, 10, 3, 8)
        done = next(t for t, r in enumerate(rows) if r["finished"])
        admitted[version] = next(t for t, r in enumerate(rows) if r["prefilled"] and t > done) - done
    assert admitted == {"0.5.21": 2, "0.5.22": 1, "0.5.23": 1}


def test_the_latch_is_released_by_the_decode_step_not_the_finish():
    """A pool that holds two: the third request latches batch_full (NO_TOKEN). 0.5.23 releases the
    latch in the step after the finish and admits; 0.5.22 decodes the remaining request first.
    Overlap off: with it, 0.5.22's decode that leaves out the request finishing in flight releases
    the latch a step earlier (the batch shrank, L4423-4424), which hides the difference."""
    cfg = SglangConfig(max_total_num_tokens=2 * (100 + 20 + 1) + 5, context_len=2048, overlap=False)
    users = [SimRequest("a", [50000] + [13] * 99, 5), SimRequest("b", [50001] + [13] * 99, 20),
             SimRequest("c", [50002] + [13] * 99, 20)]
    first = {}
    for version in ("0.5.22", "0.5.23"):
        sched = make_scheduler(dataclasses.replace(cfg, **scheduler_rules(version)))
        for u in users:
            sched.add(SimRequest(u.rid, list(u.prompt), u.max_tokens))
        steps = [sched.step() for _ in range(12)]
        done = next(t for t, r in enumerate(steps) if r.finished)
        first[version] = next(t for t, r in enumerate(steps) if t > done and r.prefill_tokens) - done
    assert first == {"0.5.23": 1, "0.5.22": 2}


def test_a_lingering_eos_finish_keeps_its_reserve():
    """A request finished by EOS still in the batch (0.5.22) is reserved max_new_tokens - outputs
    at new_token_ratio by the next prefill pass, as `_get_running_request_total_token_offset`
    reads len(output_ids) of every request in running_batch.reqs; one finished by length adds 0."""
    sched = make_scheduler(dataclasses.replace(TWO_SLOTS, **scheduler_rules("0.5.22")))
    sched.lingering = [(300, False), (0, True)]
    assert sched._lingering_reserve() == pytest.approx(300 * sched.ratio)
    assert make_scheduler(TWO_SLOTS)._lingering_reserve() == 0.0


def test_the_overlap_scheduler_decodes_a_last_token_in_flight_up_to_0_5_21():
    """One request, O=3, overlap: its third token is in flight at step 3. 0.5.21 decodes it once
    more (a batch of one); 0.5.22 leaves it out and decodes nothing."""
    one = SglangConfig(max_total_num_tokens=10000, context_len=2048)
    new = history(dataclasses.replace(one, **scheduler_rules("0.5.22")), 1, 10, 3, 5)
    old = history(dataclasses.replace(one, **scheduler_rules("0.5.21")), 1, 10, 3, 5)
    assert [r["decoded"] for r in new[:4]] == [0, 1, 1, 0]
    assert [r["decoded"] for r in old[:4]] == [0, 1, 1, 1]
    assert new[3]["finished"] == old[3]["finished"] == 1
    # without overlap every token is known when the next step is built: no such decode either way
    off = dataclasses.replace(one, overlap=False, **scheduler_rules("0.5.21"))
    assert history(off, 1, 10, 3, 5) == history(dataclasses.replace(off, decode_finishing_inflight=False), 1, 10, 3, 5)


def test_the_fast_path_waits_for_the_decode_step_that_filters():
    sched = make_scheduler(dataclasses.replace(TWO_SLOTS, **scheduler_rules("0.5.19")))
    sched.add(SimRequest("u0", [50000] + [13] * 9, 50))
    for _ in range(3):
        sched.step()
    assert sched.plain_steps(10) > 0
    sched.lingering = [(0, True)]
    assert sched.plain_steps(10) == 0


def test_the_rule_text_names_each_release():
    assert "up to 0.5.22" in scheduler_rule_text("0.5.19") and "up to 0.5.21" in scheduler_rule_text("0.5.19")
    assert "from 0.5.22" in scheduler_rule_text("0.5.22") and "up to 0.5.22" in scheduler_rule_text("0.5.22")
    assert "from 0.5.23" in scheduler_rule_text("0.5.23") and "from 0.5.22" in scheduler_rule_text("0.5.23")
