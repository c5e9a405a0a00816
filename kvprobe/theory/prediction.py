"""What an admission prediction is, whichever the engine: the `Prediction` record and the pieces
every engine's admission model shares (how a closed loop's start and ramp are chosen, how a
simulation is described, when a simulated loop left what is modelled).

The engines' own models are `kvprobe.theory.vllm.admission` and `kvprobe.theory.sglang.admission`;
`kvprobe.theory.admission` dispatches to them."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvprobe.errors import ConfigError
from kvprobe.theory.schedsim import SEM_STOP, ClosedLoopStats


@dataclass(frozen=True)
class Prediction:
    policy: str
    limit: float  # admission limit: running plateau when saturated (int-valued for reservation engines)
    no_preemption_limit: int  # largest N with no waiting and no preemption/retraction
    binding: str  # "kv" | "max_num_seqs" | "max_running_requests" | "token_budget" | "length"
    usage_at_limit: float  # the engine's own usage gauge at the limit (0..1)
    blocks_admission: int  # vLLM: blocks needed to admit; SGLang: tokens reserved at admission
    blocks_peak: int  # vLLM: peak blocks of one request; SGLang: peak tokens held
    method: str  # "closed-form" | "schedsim"
    users: int | None = None
    running: float | None = None  # steady state at `users`
    waiting: float | None = None
    preemption_rate: float | None = None  # preemptions / retractions per 1000 steps at `users`
    limit_mean: float | None = None  # time-averaged running of the steady state behind `limit`
    how: str = ""  # how `limit` was obtained: the simulation's steps, lifetimes and standard error
    users_how: str = ""  # the same for running/waiting at `users`
    running_sem: float | None = None
    waiting_sem: float | None = None
    async_scheduling: bool | None = None  # vLLM: the scheduling mode simulated
    shared_prefix_tokens: int = 0
    start: str = ""  # "ramp" | "burst": the arrival history whose steady state gives `limit`
    probe_users: int | None = None  # the closed loop behind `limit`: its users and ramp width
    ramp_width: int | None = None
    # vLLM hybrid models: one request's blocks per KV cache group (vllm/hybrid/groups.GroupBlocks
    # as dicts), and the group holding most of them when KV binds ("full layers", ...)
    groups: tuple = ()
    binding_group: str = ""
    # Hybrid (vLLM): the largest N whose simulated closed loop (users ramped over a lifetime) never
    # waits or preempts. The groups peak at different moments, so it is above `no_preemption_limit`,
    # which holds whatever the arrivals' phase (every request at every group's peak at once) and is
    # what a probe is held to: users that start closer in phase find the clean region lower.
    clean_in_closed_loop: int | None = None
    clean_in_closed_loop_how: str = ""


def judged_plateau(prediction) -> float:
    """The running a saturated engine holds on average: what a measured plateau, itself a time
    average, is judged against. It is the limit but where a reservation engine's limit is the most it
    runs at once (SGLang from 0.5.22): each finish there leaves a slot empty until the next
    admission, 0.48 of 20 below it at O=32 (the simulated 19.52, the emulator's own count 19.4-19.5),
    a few hundredths at O=256. Any object with `limit` (and `limit_mean`) will do."""
    mean = getattr(prediction, "limit_mean", None)
    return float(prediction.limit if mean is None else mean)


class NotModelled(ConfigError):
    """The simulation left what is modelled (and checked against the engine): no prediction."""


def check_modelled(stats) -> None:
    """SGLang hybrid SWA with the radix cache on is followed exactly until a retracted request is
    re-admitted onto its old prompt path (sglang/swa/radix.py); a loop that does so is not
    a prediction."""
    if stats.swa_radix_readopted:
        raise NotModelled(
            f"with SGLang's radix cache on, {stats.swa_radix_readopted} retracted request(s) came back to their "
            "prompt still in the tree, which SGLang re-adopts by what its two LRUs evicted (not modelled); "
            "add --disable-radix-cache, or a workload that does not retract", key="disable_radix_cache")


def ramp_width(estimate: float) -> int:
    """Users join `lifetime / width` steps apart: about one per running slot per lifetime, as a
    probe's ramp adds them (each first request meets a running batch at a different phase)."""
    return max(1, math.ceil(estimate) + 2)


def describe(stats: ClosedLoopStats, start: str) -> str:
    early = f" (stopped at SEM <= {SEM_STOP:.1%} of running)" if stats.stopped_early else ""
    return (f"schedsim, {start} start: {stats.simulated:,} steps, {stats.lifetimes:.0f} lifetimes of "
            f"{stats.lifetime:,} measured{early}, SEM {stats.running_sem:.2f}")


def with_policy(config, policy: str):
    if policy == "worst-case" or policy == config.policy:
        return config
    return replace(config, policy=policy)


def cap_binding(limit: int, cap: int, name: str) -> str:
    return name if limit >= cap else "kv"
