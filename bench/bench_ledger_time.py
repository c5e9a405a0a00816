"""Ledger time against output length, and the fast path's error against the step-by-step simulation.

The admission prediction (limit, usage at the limit, running/waiting at N users) is a closed-loop
simulation run for several request lifetimes; its cost grows with the output length. This bench
times `admission.predict(..., users=N)` (what `kvprobe ledger --users N` computes) for outputs of
256 … 32,768 tokens in a 1M-token pool, and for 1,000 running requests, for both engines, with
the simulation's cache cleared first, with wall and CPU seconds and the load average (this machine
is shared). The issue's budget is 2 s per ledger on this machine.
Then it runs the same closed loops with and without the event-driven fast path and prints the
largest difference of any statistic (exact: 0) and the speed-up.
"""

from __future__ import annotations

import dataclasses
import os
import time

from kvprobe.theory import schedsim
from kvprobe.theory.admission import predict
from kvprobe.theory.schedsim import SglangConfig, VllmConfig, closed_loop

POOL = 1 << 20  # tokens
OUTPUTS = (256, 1024, 4096, 8192, 16384, 32768)
P = 512
BUDGET_S = 2.0


def _configs(max_len: int):
    return {
        "vllm-0.33 async": VllmConfig(num_gpu_blocks=POOL // 16 + 1, max_num_seqs=1024, max_num_batched_tokens=8192,
                                      max_model_len=max_len, async_scheduling=True),
        "sglang-0.5.22": SglangConfig(max_total_num_tokens=POOL, max_running_requests=1024, context_len=max_len),
    }


def _timed(config, p, o, users) -> tuple[float, float, object]:
    """Wall and CPU seconds of one ledger (CPU time shows the cost on a machine others load)."""
    schedsim._closed_loop.cache_clear()
    t0, c0 = time.perf_counter(), time.process_time()
    pred = predict(config, p, o, users=users)
    return time.perf_counter() - t0, time.process_time() - c0, pred


def _load() -> str:
    """The machine's load average: other processes stretch wall time, not CPU time."""
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def time_vs_output() -> list[str]:
    lines = [f"ledger time (limit + running at N users), pool {POOL:,} tokens, P={P}; {_load()}:"]
    worst = 0.0
    for o in OUTPUTS:
        for name, cfg in _configs(P + o + 8).items():
            users = int(2.2 * POOL / (P + o)) + 4
            seconds, cpu, pred = _timed(cfg, P, o, users)
            worst = max(worst, seconds)
            lines.append(f"  O={o:6,}  {name:16s} {seconds:6.2f} s (cpu {cpu:5.2f})   limit {pred.limit:>8}"
                         f"  running {pred.running:8.2f}"
                         f"  (N={users}; {pred.users_how})")
    for name, cfg in _configs(2048).items():  # 1,000 running: P + O = 1,024 tokens in the 1M pool
        seconds, cpu, pred = _timed(dataclasses.replace(cfg), 256, 768, 1200)
        worst = max(worst, seconds)
        lines.append(f"  1,000 running  {name:16s} {seconds:6.2f} s (cpu {cpu:5.2f})   limit {pred.limit:>8}"
                     f"  running {pred.running:8.2f}")
    lines.append(f"  slowest {worst:.2f} s (budget {BUDGET_S:g} s: {'within' if worst < BUDGET_S else 'OVER'});"
                 f" {_load()}")
    return lines


def fast_path_error() -> list[str]:
    shapes = [
        ("vllm sync, preempting", VllmConfig(num_gpu_blocks=1000, max_num_seqs=1024, max_num_batched_tokens=8192,
                                             max_model_len=8192), 512, 1024, 40, 0),
        ("vllm async, shared 256", VllmConfig(num_gpu_blocks=1000, max_num_seqs=1024, max_num_batched_tokens=8192,
                                              max_model_len=8192, async_scheduling=True), 512, 1024, 40, 256),
        ("sglang radix off", SglangConfig(max_total_num_tokens=16384, context_len=8192, disable_radix_cache=True),
         512, 4096, 8, 0),
        ("sglang 0.5.21 retracting", SglangConfig(max_total_num_tokens=16384, context_len=8192,
                                                  policy="sglang-0.5.21"), 512, 1024, 40, 128),
    ]
    lines = ["fast path vs step-by-step (same closed loop, 8 lifetimes):"]
    for name, cfg, p, o, users, k in shapes:
        schedsim._closed_loop.cache_clear()
        t0 = time.perf_counter()
        fast = closed_loop(cfg, p, o, users, shared_prefix_tokens=k, fast=True)
        t1 = time.perf_counter()
        slow = closed_loop(cfg, p, o, users, shared_prefix_tokens=k, fast=False)
        t2 = time.perf_counter()
        error = max(abs(float(a) - float(b)) for a, b in zip(dataclasses.astuple(fast), dataclasses.astuple(slow),
                                                             strict=True))
        lines.append(f"  {name:26s} max |difference| {error:g}   {t2 - t1:6.2f} s stepped, {t1 - t0:5.2f} s fast "
                     f"({(t2 - t1) / max(t1 - t0, 1e-9):5.1f}x); running {fast.running_mean:.2f}")
    return lines


def main() -> str:
    report = "\n".join(time_vs_output() + fast_path_error())
    print(report)
    return report


if __name__ == "__main__":
    main()
