"""SGLang's plateau depends on the users' phases: the ledger's ramp must spread them.

SGLang runs a prefill batch whenever one can be built and decodes only when none can
(managers/scheduler.py get_next_batch_to_run, "Run prefill first if possible": 0.5.19 L3446-3455,
0.5.23 L3992-4001). On the mid-tier pair's 0.5.19 side (expectations/diff/sglang-mid-tier-shadow.yaml:
P=1760, O=32, 41,242 tokens, 2,048-token chunks) every prompt takes a prefill pass of its own, so
the requests that are prefilled back to back decode, finish and refill together: a cohort. How
many cohorts the running requests form is set by how the users arrived, and it stays:

- everyone at once (burst): one cohort of 23, refilled over ~20 prefill passes: 18.3 running;
- the ledger's old ramp, 25 users a step apart, the same (users a step apart are prefilled before
  anyone decodes): 18.1;
- users two steps apart (one prefill pass, then a decode): spread phases, one admission per
  finish: 22.4, the steady state the ledger now reports (sglang/admission.spread_ramp_width);
- the probe's levels 8, 16, 28, 34, each level's users at once: two cohorts (8 and 15; the
  shadow's engine log shows the same two), 20.9 and 21.3 at 28 and 34 users, where SGLang 0.5.19's
  shadow measured 20.51 and 21.18 (docs/diff.md, "SGLang's memory rules");
- levels two users apart (the file's levels now): small cohorts, 22.0-22.1 at the deep levels.
Those figures ran 0.5.23's scheduler loop. With 0.5.19's own (a finished request holds its place
until the next decode step; a last in-flight token is decoded: kvprobe/theory/sglang/releases.py
scheduler_rules, equal to 0.5.19's Scheduler step by step in tests/theory/matrix_real_sglang_releases.py)
the ledger reports 21.79 (0.5.20: 7.56), the probe's first levels run 19.5-19.6 at 28 and 34 users
(below the shadow's 20.5-21.2: the closed loop resubmits a finished request before the next step,
the probe's client later) and the levels two apart 21.5-21.6 (the shadow: 22.01, 22.14).
"""

from __future__ import annotations

from kvprobe.theory.admission import predict
from kvprobe.theory.schedsim import SglangConfig, SimRequest, make_scheduler, workload_prompt
from kvprobe.theory.sglang.admission import spread_ramp_width
from kvprobe.theory.sglang.releases import scheduler_rules

P, O = 1760, 32  # noqa: E741
# each release's scheduler loop (kvprobe/theory/sglang/releases.py scheduler_rules): a finished request
# holds its place to the next decode step, a last in-flight token is decoded
MID_TIER_0519 = SglangConfig(max_total_num_tokens=41242, page_size=1, max_running_requests=4096,
                             chunked_prefill_size=2048, context_len=2048, policy="sglang-0.5.21",
                             **scheduler_rules("0.5.19"))
MID_TIER_0520 = SglangConfig(max_total_num_tokens=15879, page_size=1, max_running_requests=3969,
                             chunked_prefill_size=4096, context_len=2048, policy="sglang-0.5.21",
                             **scheduler_rules("0.5.20"))


def levels_plateaus(cfg: SglangConfig, levels: list[int], steps: int) -> list[float]:
    """Mean running per level of a probe-like history: each level's new users send their first
    request together, every finished request is resent before the next step; a level's first 30%
    of steps is warm-up (as the probe's hold)."""
    sched, count, users, pending, t, out = make_scheduler(cfg), 0, 0, [], 0, []
    for n in levels:
        pending += [t] * (n - users)
        users, total, k = n, 0, 0
        for i in range(steps):
            due = [x for x in pending if x <= t]
            pending = [x for x in pending if x > t]
            for _ in due:
                sched.add(SimRequest(f"u{count}", workload_prompt(count, P, 0), O))
                count += 1
            pending += [t + 1] * len(sched.step().finished)
            if i >= 0.3 * steps:
                total, k = total + sched.stats.running, k + 1
            t += 1
        out.append(total / k)
    return out


def test_ramp_width_keeps_users_a_prefill_pass_apart():
    # 0.5.19: a lifetime of 1 + 31 steps, one prefill pass a prompt: users at least 2 steps apart
    assert spread_ramp_width(MID_TIER_0519, P, O, 23) == 16
    # 0.5.20 (4,096-token chunks, 8 fit): the usual width (prediction.ramp_width) is already spread
    assert spread_ramp_width(MID_TIER_0520, P, O, 8) == 10


def test_ledger_reports_the_spread_steady_state():
    pred = predict(MID_TIER_0519, P, O, users=34)
    # 22.38 with 0.5.23's scheduler loop (18.3 from a burst, 18.1 from the old ramp); 0.5.19's loop: 21.79
    assert pred.start == "ramp" and abs(pred.limit - 21.8) < 0.3, pred.how
    assert abs(pred.running - pred.limit) < 0.3  # the steady state at 34 users from the same start
    assert predict(MID_TIER_0520, P, O).limit == 7.56  # 7.8 with 0.5.23's loop; 0.5.20's own Scheduler: 7.56


def test_probe_levels_plateau_between_burst_and_spread():
    deep = levels_plateaus(MID_TIER_0519, [8, 16, 28, 34], 132)[2:]
    assert all(19.2 < x < 19.9 for x in deep), deep  # the shadow: 20.51 and 21.18 (0.5.23's loop: 20.9, 21.3)


def test_levels_two_users_apart_run_near_the_spread_state():
    # the mid-tier file's levels: small cohorts, deep levels within 0.4 of the ledger's 21.79 (0.5.19's
    # scheduler loop; 22.0-22.1 against 22.38 with 0.5.23's)
    deep = levels_plateaus(MID_TIER_0519, [*range(2, 23, 2), 28, 34], 132)[-2:]
    assert all(21.4 < x < 21.8 for x in deep), deep
