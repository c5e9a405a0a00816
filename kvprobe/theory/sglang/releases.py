"""SGLang's rules that change from release to release: the admission policy a version runs. The
version strings themselves (the default release, the known ones) are `kvprobe.releases`'; the
engine's dialect (`kvprobe.engines.sglang`) and the ledger both ask here, so a version runs the
same policy in the emulator and in the ledger."""

from __future__ import annotations

from kvprobe.releases import version_tuple

# --max-prefill-tokens default (python/sglang/srt/server_args.py, 0.5.23): the prefill budget of a
# scheduling pass, and the activation estimate's token count when chunked prefill is off.
MAX_PREFILL_TOKENS = 16384


def policy(version: str) -> str:
    """The admission policy (schedsim's name) of an SGLang version: 0.5.22 and later reserve an
    ignore_eos request's output at ratio 1.0; 0.5.21 and older scale it by new_token_ratio
    (python/sglang/srt/managers/schedule_policy.py `PrefillAdder._get_running_request_total_token_offset`:
    0.5.21 L788-795, 0.5.22 L754-763). Both sides run on their shadows (docs/diff.md, 0.5.21 -> 0.5.22)."""
    return "sglang-0.5.21" if version_tuple(version) <= (0, 5, 21) else "sglang-0.5.22"


# What each policy's rule says, in the words a diff between two releases names it with (`kvprobe diff`).
RULES = {"sglang-0.5.21": "an ignore_eos request's output reserved at new_token_ratio, up to 0.5.21",
         "sglang-0.5.22": "an ignore_eos request's output reserved in full (ratio 1.0) from 0.5.22"}


# Two rules of SGLang's scheduler loop that older releases run differently; the simulation's config
# carries them (SglangConfig.finished_leave_at_decode / decode_finishing_inflight, from
# `scheduler_rules`), so the ledger and the emulator of a release step as that release does.
#
# A finished request leaves the running batch, and with it the batch-full latch is released, every
# step from 0.5.23 (managers/scheduler.py L3963-3968: `running_batch.filter_batch()` before the
# prefill decision). Up to 0.5.22 that filter runs only for a prefill-only batch (0.5.22 L3837-3845,
# 0.5.19 L3414-3422) and otherwise in `update_running_batch` (0.5.19 L3869-3875, L3943-3944; 0.5.22
# L4335-4343, L4423-4424): the finished request still counts in the running batch (its room for
# get_num_allocatable_reqs, its reserve in PrefillAdder) and the latch stays set until the next step
# that decodes. Read in 0.5.19-0.5.23; 0.5.14-0.5.18 filter likewise only in update_running_batch (0.5.14
# L2995-3002) and have no `_reqs_finishing_inflight`. Driven step by step on 0.5.19, 0.5.21 and 0.5.22
# (tests/theory/matrix_real_sglang_releases.py).
FINISHED_LEAVE_EVERY_STEP_FROM = (0, 5, 23)
# The overlap scheduler leaves a request whose in-flight token is its last by length out of the next
# decode from 0.5.22 (`_reqs_finishing_inflight`, 0.5.22 scheduler.py L4320-4343, set on by
# event_loop_overlap L1977); 0.5.21 has no such method and decodes it once more (L4191-4199).
SKIP_FINISHING_DECODE_FROM = (0, 5, 22)


def scheduler_rules(version: str) -> dict[str, bool]:
    """The simulation config's per-release scheduler fields (SglangConfig) of an SGLang version."""
    v = version_tuple(version)
    return {"finished_leave_at_decode": v < FINISHED_LEAVE_EVERY_STEP_FROM,
            "decode_finishing_inflight": v < SKIP_FINISHING_DECODE_FROM}


def scheduler_rule_text(version: str) -> str:
    """The scheduler-loop rules a version runs, in the ledger's words (its "release rules" table)."""
    r = scheduler_rules(version)
    leave = ("a finished request leaves the running batch (and releases the batch-full latch) at the next "
             "decode step, up to 0.5.22 (scheduler.py update_running_batch)" if r["finished_leave_at_decode"]
             else "a finished request leaves the running batch every step, from 0.5.23 (scheduler.py "
                  "get_next_batch_to_run filter_batch)")
    last = ("the overlap scheduler decodes a request whose in-flight token is its last, up to 0.5.21"
            if r["decode_finishing_inflight"] else
            "the overlap scheduler skips the decode of a request whose in-flight token is its last, from 0.5.22 "
            "(scheduler.py _reqs_finishing_inflight)")
    return f"{leave}; {last}"
