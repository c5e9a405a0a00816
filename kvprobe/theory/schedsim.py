"""Virtual-time, step-by-step schedulers of vLLM 0.33 and SGLang 0.5.23 (and their older policies).

One `step()` is one engine iteration. The emulator runs the same objects in real time: it calls
`add` for a new request, `abort` when a client disconnects, `step` in its loop, streams
`StepResult.emitted` and exports `stats`. Rules and citations come from the engines' own code
(file:line in each scheduler module: vllm/v1/core/sched/scheduler.py and kv_cache_manager.py;
python/sglang/srt/managers/scheduler.py and schedule_policy.py), and are checked against the engines' own
schedulers driven on a CPU: vLLM 0.33.0's Scheduler and AsyncScheduler (window means equal) and SGLang
0.5.23's Scheduler (equal after every step), tests/theory/test_real_vllm.py and test_real_sglang.py.

Speed: running requests live in numpy columns (`Lanes`), so a decode step over 1,000 requests is
a handful of vector operations; Python code runs only on events (admission, finish, preemption,
retraction, a prefill chunk, prefix-cache hashing), and a vLLM request's own cached blocks are one
free-queue entry however many it holds (`vllm/block_pool.py`). `closed_loop` goes further: each
scheduler's `jump` (vllm/fastpath.py, sglang/fastpath.py) applies stretches of plain decode
steps in closed form and, for vLLM, the steps that end them, with the results of `step()` exactly.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass
from functools import lru_cache

import numpy as np

from kvprobe.errors import ConfigError
from kvprobe.theory.model.sizes import cdiv
from kvprobe.theory.sglang.schedule_policy import CLIP_MAX_NEW_TOKENS  # noqa: F401
from kvprobe.theory.sglang.scheduler import RETRACT_DECODE_STEPS, SglangScheduler  # noqa: F401
from kvprobe.theory.sglang.swa.radix import SglangSwaRadixScheduler
from kvprobe.theory.sglang.swa.scheduler import SglangSwaScheduler, is_hybrid_swa
from kvprobe.theory.sim.core import (  # noqa: F401 — the public API is imported from here
    Emitted,
    SchedulerStats,
    SglangConfig,
    SimRequest,
    StepResult,
    VllmConfig,
)
from kvprobe.theory.sim.pools import VOCAB
from kvprobe.theory.vllm.hybrid.scheduler import HybridVllmScheduler, is_hybrid
from kvprobe.theory.vllm.scheduler import VllmScheduler


def make_scheduler(config: VllmConfig | SglangConfig) -> VllmScheduler | SglangScheduler:
    if isinstance(config, VllmConfig):
        if is_hybrid(config):
            return HybridVllmScheduler(config)
        return VllmScheduler(config)
    if isinstance(config, SglangConfig):
        if is_hybrid_swa(config):
            return SglangSwaScheduler(config) if config.disable_radix_cache else SglangSwaRadixScheduler(config)
        return SglangScheduler(config)
    raise ConfigError(f"expected VllmConfig or SglangConfig, got {type(config).__name__}")


# --------------------------------------------------------------------------- closed loop

MIN_BATCH_STEPS = 200  # a batch mean shorter than this is mostly noise from one admission wave
TARGET_COMPLETIONS = 2000  # requests the measured window should see finish (sets its lifetimes)
SEM_STOP = 0.005  # a default window ends early once the SEM of running and waiting is this small
MIN_STOP_LIFETIMES = 2  # ... but not before it covers this many lifetimes and four batches


@dataclass(frozen=True)
class ClosedLoopStats:
    running_mean: float
    running_max: int
    waiting_mean: float
    waiting_max: int
    usage_mean: float  # the engine's usage gauge, time average (unrounded)
    usage_at_full: float  # mean usage gauge over steps with someone waiting (max usage if none)
    preemptions_per_1k_steps: float  # vLLM preemptions / SGLang retractions
    steps: int  # length of the measured window
    running_sem: float = 0.0  # standard error of the mean (batch means over the window)
    waiting_sem: float = 0.0
    usage_sem: float = 0.0
    lifetimes: float = 0.0  # request lifetimes the window covers
    warmup: int = 0  # steps simulated before the window (arrivals + settling)
    lifetime: int = 0  # steps of one request's life without queueing: prefill steps + O
    running_min: int = 0
    stopped_early: bool = False  # the window ended at the SEM target, before its full length
    # SGLang hybrid SWA: the share of refused admissions in the window that the window pool refused
    window_blocked: float = 0.0
    swa_usage_mean: float = 0.0  # ... and the window pool's used slots over its size, time average
    # ... radix cache on: re-admissions onto an old tree path in the whole run (not modelled from the
    # first on: sglang/swa/radix.py)
    swa_radix_readopted: int = 0

    @property
    def simulated(self) -> int:
        return self.warmup + self.steps


def request_lifetime(config: VllmConfig | SglangConfig, prompt_tokens: int, output_tokens: int) -> int:
    """Steps one request lives when nothing else runs: its prefill chunks, then O - 1 decodes."""
    if isinstance(config, VllmConfig):
        chunk = config.max_num_batched_tokens
    else:
        chunk = config.chunked_prefill_size if config.chunked_prefill_size > 0 else prompt_tokens
    return cdiv(prompt_tokens, max(chunk, 1)) + output_tokens - 1


def arrival_steps(lifetime: int, users: int, start: str = "ramp", ramp_width: int | None = None) -> list[int]:
    """The step at which each user of a closed loop sends its first request: all at step 0
    ("burst"), or a ramp of `lifetime // width` steps between users (width: ramp_width, at most
    N), so that the first requests span one lifetime; with more users than steps in a lifetime,
    several join in a step and the ramp still spans one lifetime."""
    if start == "burst":
        return [0] * users
    width = max(1, min(users, ramp_width or users))
    if lifetime >= width:
        return [u * (lifetime // width) for u in range(users)]
    return [u * lifetime // width for u in range(users)]


def workload_prompt(serial: int, prompt_tokens: int, shared_prefix_tokens: int = 0) -> list[int]:
    """The structure of the load generator's prompts (kvprobe/load/prompts.py) without its ids:
    K tokens shared by every request, then a token no other request has, then filler (the same for
    all: after a unique token no block or page can match another prompt's)."""
    K = shared_prefix_tokens
    need = max(K, prompt_tokens - K - 1)
    if len(_PREFIX) < need:  # grown once, sliced per request (list slices are C copies)
        _PREFIX[:] = [7 + (i * 7919) % 30011 for i in range(2 * need)]
        _FILLER[:] = [13 + (i * 104729) % 30011 for i in range(2 * need)]
    return _PREFIX[:K] + [VOCAB + serial] + _FILLER[: prompt_tokens - K - 1]


_PREFIX: list[int] = []
_FILLER: list[int] = []


def closed_loop(config: VllmConfig | SglangConfig, prompt_tokens: int, output_tokens: int, users: int, *,
                shared_prefix_tokens: int = 0, start: str = "ramp", ramp_width: int | None = None,
                lifetimes: float | None = None, warmup_lifetimes: float | None = None, batches: int = 8,
                fast: bool = True, seed: int = 0, sem_stop: float | None = None) -> ClosedLoopStats:
    """The steady state of N users in a closed loop of fixed-length requests (ignore_eos, zero
    client latency, one engine step per time unit).

    Start: "ramp" (default) lets users join one at a time, `lifetime / ramp_width` steps apart
    (ramp_width defaults to N: every user's first request within one lifetime), as a probe's ramp
    adds users; "burst" starts everyone at step 0 (in phase, the worst case). After the last user
    joined, `warmup_lifetimes` request lifetimes settle (default 2; 1 with 200 or more in flight);
    then the window of at least `lifetimes` lifetimes is measured in `batches` equal batches, whose
    means give the standard error. By default the window sees about TARGET_COMPLETIONS requests
    finish, within 2 to 8 lifetimes (many concurrent requests average out sooner), and ends at
    the first batch boundary after MIN_STOP_LIFETIMES lifetimes and four batches where the
    standard errors of running and waiting are within SEM_STOP of the running mean (a steady
    state that no longer moves, such as a reservation bound, needs no more); `sem_stop` sets
    that fraction (0: never early), and with explicit `lifetimes` the window has its full length.
    Stats are sampled after each step, where the engines sample their gauges: after finished
    requests left and before their users resubmit. `fast` jumps over plain decode stretches and
    the preemptions that end them (`jump` of each scheduler); the result is identical to
    stepping, only faster.
    `seed` is accepted for callers that vary the workload; prompts are deterministic."""
    if start not in ("ramp", "burst"):
        raise ConfigError(f"start must be 'ramp' or 'burst', got {start!r}")
    if users < 1:
        raise ConfigError(f"users must be >= 1, got {users}")
    if not 0 <= shared_prefix_tokens < prompt_tokens:
        raise ConfigError(f"shared_prefix_tokens must be in [0, prompt_tokens), got {shared_prefix_tokens}")
    width = max(1, min(users, ramp_width or users))
    if sem_stop is None:
        sem_stop = SEM_STOP if lifetimes is None else 0.0
    if lifetimes is None:
        lifetimes = min(8, max(2, math.ceil(TARGET_COMPLETIONS / width)))
    if warmup_lifetimes is None:
        warmup_lifetimes = 2 if width < 200 else 1
    return _closed_loop(type(config), astuple(config), prompt_tokens, output_tokens, users, shared_prefix_tokens,
                        start, ramp_width or users, float(lifetimes), float(warmup_lifetimes), int(batches), fast,
                        float(sem_stop))


def _batch_sems(B: np.ndarray, n: int) -> np.ndarray:
    """Standard errors of running, waiting and used tokens from the first n batch means."""
    if n < 2:
        return np.zeros(3)
    means = B[:3, :n] / B[3, :n]
    return means.std(axis=1, ddof=1) / math.sqrt(n)


@lru_cache(maxsize=512)
def _closed_loop(kind, fields, P, n_out, users, K, start, ramp_width, lifetimes, warmup_lifetimes,
                 batches, fast, sem_stop) -> ClosedLoopStats:
    config = kind(*fields)
    sched = make_scheduler(config)
    life = request_lifetime(config, P, n_out)
    arrivals = arrival_steps(life, users, start, ramp_width)
    t0 = arrivals[-1] + math.ceil(warmup_lifetimes * life)
    batch_len = max(math.ceil(lifetimes * life / batches), MIN_BATCH_STEPS)
    window = batch_len * batches
    t_end = t0 + window
    # batch boundaries where the window may end early (see closed_loop)
    stop_from = max(4, math.ceil(MIN_STOP_LIFETIMES * life / batch_len)) if sem_stop > 0 else batches
    next_check = t0 + stop_from * batch_len if stop_from < batches else t_end
    B = np.zeros((4, batches), np.int64)  # per batch: running, waiting, used tokens, steps
    full_used = full_steps = 0
    run_max = wait_max = 0
    run_min = 1 << 62
    count = 0
    preempt_at_t0 = 0
    blocked_at_t0 = (0, 0)
    swa_sum = 0  # window pool slots over the measured steps (hybrid SWA steps: it has no jumps)

    def submit() -> None:
        nonlocal count
        sched.add(SimRequest(f"u{count}", workload_prompt(count, P, K), n_out))
        count += 1

    def record(t: int, k: int, running: int, waiting: int, used_sum: int) -> None:
        nonlocal full_used, full_steps, run_max, wait_max, run_min
        b = (t - t0) // batch_len
        B[0, b] += k * running
        B[1, b] += k * waiting
        B[2, b] += used_sum
        B[3, b] += k
        run_max, wait_max, run_min = max(run_max, running), max(wait_max, waiting), min(run_min, running)
        if waiting:
            full_used += used_sum
            full_steps += k

    # `due`: the last jump stopped short of its limit before an event it leaves to step() (SGLang's
    # jumps; vLLM's do the events of a plain state themselves): step it
    # without asking. `idle`: steps to go before asking again after asking found no stretch
    # (asking costs O(running); when events come every step, ask less often: stepping is exact).
    t, nxt, idle, misses, due = 0, 0, 0, 0, False
    while t < t_end:
        if t == next_check:
            done = (t - t0) // batch_len
            sem = _batch_sems(B, done)
            if max(sem[0], sem[1]) <= sem_stop * max(B[0, :done].sum() / B[3, :done].sum(), 1.0):
                t_end = t
                break
            next_check += batch_len
        while nxt < users and arrivals[nxt] <= t:
            submit()
            nxt += 1
        if t == t0:
            preempt_at_t0 = sched.stats.preemptions_total
            blocked_at_t0 = (sched.stats.no_token_total, sched.stats.window_no_token_total)
        if fast and (due or idle):
            idle -= not due and idle > 0
            due = False
        elif fast:
            boundary = t0 if t < t0 else t0 + ((t - t0) // batch_len + 1) * batch_len
            if nxt < users:
                boundary = min(boundary, arrivals[nxt])
            segments, finished = sched.jump(boundary - t)
            if segments:
                misses = 0
                for k, running, waiting, used_sum in segments:
                    if t >= t0:
                        record(t, k, running, waiting, used_sum)
                    t += k
                for _ in finished:
                    submit()
                due = sched.jump_leaves_events and t < boundary
                continue
            misses += 1
            idle = min(misses, 8) - 1
        result = sched.step()
        if t >= t0:
            s = sched.stats
            record(t, 1, s.running, s.waiting, s.used_tokens)
            swa_sum += s.swa_used_tokens
        t += 1
        for _ in result.finished:
            submit()
    pool = sched.stats.pool_tokens
    done = (t_end - t0) // batch_len
    window = done * batch_len
    sem = _batch_sems(B, done)
    used_mean = B[2].sum() / window
    refused = sched.stats.no_token_total - blocked_at_t0[0]
    by_window = sched.stats.window_no_token_total - blocked_at_t0[1]
    return ClosedLoopStats(
        running_mean=float(B[0].sum() / window), running_max=int(run_max),
        waiting_mean=float(B[1].sum() / window), waiting_max=int(wait_max),
        usage_mean=float(used_mean / pool),
        usage_at_full=float(full_used / full_steps / pool) if full_steps else float(used_mean / pool),
        preemptions_per_1k_steps=(sched.stats.preemptions_total - preempt_at_t0) * 1000 / window,
        steps=window, running_sem=float(sem[0]), waiting_sem=float(sem[1]), usage_sem=float(sem[2] / pool),
        lifetimes=window / life, warmup=t0, lifetime=life, running_min=int(run_min), stopped_early=done < batches,
        window_blocked=by_window / refused if refused else 0.0,
        swa_usage_mean=swa_sum / window / sched.stats.swa_pool_tokens if sched.stats.swa_pool_tokens else 0.0,
        swa_radix_readopted=sched.stats.swa_radix_readopted)
