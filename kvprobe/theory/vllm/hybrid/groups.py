"""A hybrid model's vLLM KV cache groups as the ledger and the admission model show them: the
planner's groups (kv_cache_planning.VllmKVPlan) turned into the scheduler's groups (block_pool.KVGroup), and
what one request holds in each group — at admission, at its peak and on average over its life —
measured by running it alone through the simulated engine (hybrid/scheduler.py), so the figures
follow the engine's own rules (window frees on the processed basis, the admission cap, Mamba's
state blocks) rather than a formula beside them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvprobe.theory.schedsim import arrival_steps, request_lifetime, workload_prompt
from kvprobe.theory.sim.core import SimRequest, VllmConfig
from kvprobe.theory.vllm.hybrid.kv_cache_manager import CHUNKED, FULL, MAMBA, SLIDING, KVGroup
from kvprobe.theory.vllm.hybrid.kv_cache_planning import VllmKVPlan
from kvprobe.theory.vllm.hybrid.kv_cache_spec import (
    CHUNKED_SPEC,
    FULL_SPEC,
    MAMBA_SPEC,
    SLIDING_SPEC,
)
from kvprobe.theory.vllm.hybrid.scheduler import HybridVllmScheduler, kv_groups

_KIND = {FULL_SPEC: FULL, SLIDING_SPEC: SLIDING, CHUNKED_SPEC: CHUNKED, MAMBA_SPEC: MAMBA}
_LABEL = {FULL: "full layers", SLIDING: "sliding-window layers", CHUNKED: "chunked-local layers",
          MAMBA: "linear-attention (Mamba) layers"}


def group_label(group: KVGroup) -> str:
    """'full layers', 'sliding-window layers (window 128)', ... — the name a binding limit carries."""
    if group.kind in (SLIDING, CHUNKED):
        return f"{_LABEL[group.kind]} ({'window' if group.kind == SLIDING else 'chunk'} {group.window})"
    return _LABEL[group.kind]


def sched_groups(plan: VllmKVPlan) -> tuple[KVGroup, ...]:
    """The plan's groups as the scheduler's KV cache manager runs them, in the planner's order;
    groups of one spec (Gemma 3's five window groups) are one KVGroup with `copies`."""
    out: list[KVGroup] = []
    for g in plan.groups:
        spec = next(s for s in plan.specs if s.name == g.layers[0])
        window = spec.sliding_window or spec.attention_chunk_size or 0
        block = g.block_size if g.block_size != plan.block_size else 0
        # FlashInfer's GDN prefill: one checkpoint block on the prefix-cache grid (qwen_gdn_linear_attn.py
        # L739-750); without an alignment the scheduler never takes one (kv_cache_interface.py L1197-1198)
        checkpoint = (spec.prefill_checkpoint_alignment or 0) if spec.num_prefill_checkpoint_blocks else 0
        group = KVGroup(_KIND[g.spec], 1, window, block, checkpoint)
        if out and dataclasses.replace(out[-1], copies=1) == group:
            out[-1] = dataclasses.replace(out[-1], copies=out[-1].copies + 1)
        else:
            out.append(group)
    return tuple(out)


@dataclass(frozen=True)
class GroupBlocks:
    """One group (all its copies) of one request: blocks held after admission, at the peak and
    on average over the request's steps; `layers` counts the model layers in the group."""

    group: str
    kind: str
    copies: int
    layers: int
    blocks_admission: int
    blocks_peak: int
    blocks_mean: float


def request_group_blocks(cfg: VllmConfig, P: int, O: int, layers: list[int] | None = None) -> list[GroupBlocks]:  # noqa: E741
    """What one request of P prompt and O output tokens holds in each group when it runs alone
    (a pool large enough for it), step by step through the simulated engine."""
    groups = kv_groups(cfg)
    alone = HybridVllmScheduler(dataclasses.replace(cfg, num_gpu_blocks=1 << 20, max_num_seqs=1))
    req = SimRequest("alone", workload_prompt(0, P), O)
    alone.add(req)
    fresh = dataclasses.replace(req._kv, num_tokens=P)
    # the admission check's blocks: the prompt in every group, window and chunk groups capped
    # (allocate_slots with full_must_fit, kv_cache_manager.py L380-627)
    admit = [m.blocks_to_allocate(fresh, min(P, cfg.max_model_len), [], 0, cap=True,
                                  prefill_end=alone.kvm.prefill_end(fresh)) for m in alone.kvm.managers]
    per_step: list[list[int]] = []
    while alone.has_work():
        alone.step()
        per_step.append([m.held("alone") for m in alone.kvm.managers])
        if len(per_step) > 4 * (P + O) + 16:
            raise AssertionError("one request alone did not finish")
    steps = [s for s in per_step if any(s)] or [[0] * len(alone.kvm.managers)]
    out, first = [], 0
    for i, g in enumerate(groups):
        ids = range(first, first + g.copies)
        first += g.copies
        held = [sum(s[j] for j in ids) for s in steps]
        out.append(GroupBlocks(group_label(g), g.kind, g.copies, (layers or [0] * len(groups))[i],
                               sum(admit[j] for j in ids), max(held), round(sum(held) / len(held), 2)))
    return out


def group_layers(plan: VllmKVPlan) -> list[int]:
    """Model layers per sched_groups entry (padding slots excluded)."""
    out: list[int] = []
    groups = sched_groups(plan)
    it = iter(plan.groups)
    for g in groups:
        out.append(sum(len(next(it).layers) for _ in range(g.copies)))
    return out


# How long a clean run must stay clean after its last user joined: the users' phases then repeat
# every lifetime (each request lives its lifetime and its user resubmits at once), so two cover
# the pattern, and the third any drift a shared prefill budget leaves in it.
CLEAN_LIFETIMES = 3


def runs_clean(cfg: VllmConfig, P: int, O: int, users: int, *, ramp_width: int,  # noqa: E741
               shared_prefix_tokens: int = 0) -> bool:
    """Whether `users` in the closed loop — arrivals as schedsim.closed_loop's ramp start, users
    `lifetime // ramp_width` steps apart — run through vLLM's scheduler (the simulated one) with
    no request ever left waiting after a step and no preemption, from the first arrival until
    CLEAN_LIFETIMES lifetimes after the last."""
    sched = HybridVllmScheduler(cfg)
    life = request_lifetime(cfg, P, O)
    arrivals = arrival_steps(life, users, "ramp", ramp_width)
    count = nxt = 0
    for t in range(arrivals[-1] + CLEAN_LIFETIMES * life):
        while nxt < users and arrivals[nxt] <= t:
            sched.add(SimRequest(f"u{count}", workload_prompt(count, P, shared_prefix_tokens), O))
            count, nxt = count + 1, nxt + 1
        result = sched.step()
        if result.preempted or sched.stats.waiting:
            return False
        for _ in result.finished:
            sched.add(SimRequest(f"u{count}", workload_prompt(count, P, shared_prefix_tokens), O))
            count += 1
    return True


def no_preemption_limit(cfg: VllmConfig, P: int, O: int, *, guess: int, ramp_width: int,  # noqa: E741
                        shared_prefix_tokens: int = 0) -> int:
    """The largest N that `runs_clean`, at most max_num_seqs. The groups peak at different moments
    of a request's life (a window group in its prefill, the full group at its end, Mamba's state
    blocks throughout) and the closed loop holds requests at different moments, so it is well above
    the pool // the sum of every group's peak, close to the admission limit: from `guess` (the
    admission limit) steps of 1, 2, 4, ... up or down bracket it, then halving the bracket finds
    it (a level that is not clean stops at its first waiting step)."""
    def clean(n: int) -> bool:
        return n == 0 or runs_clean(cfg, P, O, n, ramp_width=ramp_width, shared_prefix_tokens=shared_prefix_tokens)

    S, step = cfg.max_num_seqs, 1
    n = max(1, min(S, guess))
    if clean(n):
        lo = n
        while lo < S and clean(hi := min(S, lo + step)):
            lo, step = hi, 2 * step
        if lo == S:
            return S
    else:
        hi = n
        while not clean(lo := max(0, hi - step)):
            hi, step = lo, 2 * step
    while hi - lo > 1:  # lo clean, hi not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if clean(mid) else (lo, mid)
    return lo
