"""Virtual-time, step-by-step schedulers of vLLM 0.33 and SGLang 0.5.23 (and their older policies).

One `step()` is one engine iteration. The emulator runs the same objects in real time: it calls
`add` for a new request, `abort` when a client disconnects, `step` in its loop, streams
`StepResult.emitted` and exports `stats`. Rules and citations come from
shared/reference/vllm.md §2-3 and shared/reference/sglang.md §2-3 (file:line of the engines).

Speed: running requests live in numpy columns (`Lanes`), so a decode step over 1,000 requests is
a handful of vector operations; Python code runs only on events (admission, finish, preemption,
retraction, a prefill chunk, prefix-cache hashing).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from functools import lru_cache

import numpy as np

from kvprobe.errors import ConfigError
from kvprobe.theory.pools import VOCAB
from kvprobe.theory.sched_common import (  # noqa: F401 — the public API is imported from here
    Emitted,
    SchedulerStats,
    SglangConfig,
    SimRequest,
    StepResult,
    VllmConfig,
    cdiv,
)
from kvprobe.theory.sched_sglang import CLIP_MAX_NEW_TOKENS, RETRACT_DECODE_STEPS, SglangScheduler  # noqa: F401
from kvprobe.theory.sched_vllm import VllmScheduler


def make_scheduler(config: VllmConfig | SglangConfig) -> VllmScheduler | SglangScheduler:
    if isinstance(config, VllmConfig):
        return VllmScheduler(config)
    if isinstance(config, SglangConfig):
        return SglangScheduler(config)
    raise ConfigError(f"expected VllmConfig or SglangConfig, got {type(config).__name__}")


# --------------------------------------------------------------------------- closed loop


@dataclass(frozen=True)
class ClosedLoopStats:
    running_mean: float
    running_max: int
    waiting_mean: float
    waiting_max: int
    usage_mean: float
    usage_at_full: float  # mean usage gauge over steps with someone waiting (max usage if none)
    preemptions_per_1k_steps: float  # vLLM preemptions / SGLang retractions
    steps: int  # length of the measured window


def closed_loop(config: VllmConfig | SglangConfig, prompt_tokens: int, output_tokens: int, users: int, *,
                steps: int = 3000, warmup: int = 1000, stagger: bool = False, seed: int = 0) -> ClosedLoopStats:
    """N users in a closed loop of fixed-length requests (unique prompts, ignore_eos), one engine
    step per time unit, zero client latency. Stats are sampled after each step, where the engines
    sample their gauges: after finished requests left and before their users resubmit. The window
    is steps [warmup, steps). Users start together (in phase, the worst case) unless `stagger`,
    which spreads their first requests evenly over one output lifetime."""
    return _closed_loop(type(config), astuple(config), prompt_tokens, output_tokens, users,
                        steps, warmup, stagger, seed)


@lru_cache(maxsize=512)
def _closed_loop(kind, fields, P, n_out, users, steps, warmup, stagger, seed) -> ClosedLoopStats:
    sched = make_scheduler(kind(*fields))
    rng = np.random.default_rng(seed)
    count = 0

    def submit() -> None:
        nonlocal count
        prompt = rng.integers(0, VOCAB, P)
        prompt[0] = count % VOCAB  # unique from the first token (no prefix hits)
        sched.add(SimRequest(f"u{count}", prompt.tolist(), n_out))
        count += 1

    starts = sorted((u * n_out // users if stagger else 0) for u in range(users))
    window = max(steps - warmup, 1)
    running, waiting = np.zeros(window, np.int64), np.zeros(window, np.int64)
    usage = np.zeros(window)
    preempt_at_warmup = 0
    for t in range(steps):
        while starts and starts[0] <= t:
            starts.pop(0)
            submit()
        result = sched.step()
        if t == warmup - 1:
            preempt_at_warmup = sched.stats.preemptions_total
        if t >= warmup:
            s = sched.stats
            running[t - warmup], waiting[t - warmup], usage[t - warmup] = s.running, s.waiting, s.usage
        for _ in result.finished:
            submit()
    full = waiting > 0
    return ClosedLoopStats(
        running_mean=float(running.mean()), running_max=int(running.max()),
        waiting_mean=float(waiting.mean()), waiting_max=int(waiting.max()),
        usage_mean=float(usage.mean()),
        usage_at_full=float(usage[full].mean()) if full.any() else float(usage.max()),
        preemptions_per_1k_steps=(sched.stats.preemptions_total - preempt_at_warmup) * 1000 / window,
        steps=window)
