"""Speed of the schedulers: 10,000 steps with 1,000 running requests (KV does not bind).

`main()` fills each scheduler with 1,000 closed-loop users, then times 10,000 `step()` calls,
resubmitting finished requests as a closed loop does. Unique prompts; the emitted tokens are not
materialised (the emulator reads them; a closed loop does not).
"""

from __future__ import annotations

import time

import numpy as np

from kvprobe.theory.schedsim import SglangConfig, SimRequest, VllmConfig, make_scheduler

USERS, STEPS, P, O = 1000, 10_000, 128, 1024  # noqa: E741


def _run(config) -> tuple[float, float]:
    sched = make_scheduler(config)
    rng = np.random.default_rng(0)
    count = 0

    def submit():
        nonlocal count
        prompt = rng.integers(0, 32000, P)
        prompt[0] = count
        sched.add(SimRequest(f"b{count}", prompt.tolist(), O))
        count += 1

    for _ in range(USERS):
        submit()
    while sched.stats.running < USERS:  # fill (admissions are limited by the token budget)
        for _ in sched.step().finished:
            submit()
    running = 0
    t0 = time.perf_counter()
    for _ in range(STEPS):
        for _ in sched.step().finished:
            submit()
        running += sched.stats.running
    return time.perf_counter() - t0, running / STEPS


def main() -> str:
    blocks = USERS * -(-(P + O) // 16) + 64
    cases = {
        "vllm-0.33 (prefix caching on)": VllmConfig(blocks, max_num_seqs=1024, max_num_batched_tokens=8192),
        "vllm-0.33 (prefix caching off)": VllmConfig(blocks, max_num_seqs=1024, max_num_batched_tokens=8192,
                                                     enable_prefix_caching=False),
        "sglang-0.5.22 (radix on)": SglangConfig(USERS * (P + O) * 2, max_running_requests=1024),
        "sglang-0.5.22 (radix off)": SglangConfig(USERS * (P + O) * 2, max_running_requests=1024,
                                                  disable_radix_cache=True),
    }
    lines = [f"schedsim: {STEPS:,} steps, {USERS:,} users, P={P} O={O}"]
    for name, config in cases.items():
        seconds, running = _run(config)
        lines.append(f"  {name:32s} {seconds:6.3f} s  ({seconds / STEPS * 1e6:5.1f} us/step, "
                     f"running mean {running:.0f})")
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()
