"""SGLang's idle gauges, as the emulator serves them and the leak check reads them.

SGLang 0.5.23 republishes an idle scheduler's gauges at once only when the running gauge is stale,
otherwise 30 s after its last report (engines/sglang/metrics.py IDLE_REPORT_SECONDS). One request
alone is reported at its prefill (running counted *before* it: 0) and, shorter than the 40-step
decode log interval, never again: once it ends, running already reads 0, so usage keeps the prefill
report's value until the idle report. The probe's drain watch must outlast it: the leak check
passes on the correct engine, fails on one that leaks (zombie-blocks), and is inconclusive when
the watch ended before the report."""

from __future__ import annotations

import time

import pytest

from kvprobe.analysis.levels import drain_check, drain_window
from kvprobe.engines import get_dialect
from kvprobe.observe.sampler import Sampler
from kvprobe.theory.sim.steptime import TimeModel
from kvprobe.verdict.checks import check_leak
from tests.emulator.conftest import StreamClients, wait_for

pytestmark = pytest.mark.slow
SGLANG = {"max-total-tokens": 4000, "context-length": 1024, "enable-metrics": True}
STEP = TimeModel(step_ms=50.0, prefill_us_per_token=0.0, decode_us_per_seq=0.0)  # 40 decode steps: 2 s
IDLE = get_dialect("sglang").IDLE_REPORT_SECONDS
M = get_dialect("sglang").METRICS


def stream(prompt: int, out: int) -> dict:
    return {"prompt": [1000 + k for k in range(prompt)], "max_tokens": out, "min_tokens": out, "ignore_eos": True,
            "stream": True}


def test_idle_gauges_wait_for_the_report_and_the_leak_check_waits_with_them(serve):
    ok = serve("sglang", SGLANG, time_model=STEP)
    zombie = serve("sglang", SGLANG, time_model=STEP, faults=["zombie-blocks"])
    samplers = [Sampler(s.url, M, interval=0.2).start() for s in (ok, zombie)]
    try:
        t_sent = time.time()
        done = StreamClients(ok.url, [stream(100, 20)])  # 1 s, inside one decode log interval
        leaking = StreamClients(zombie.url, [stream(100, 800)])
        wait_for(lambda: zombie.value("kvprobe_emulator_running") == 1, what="the zombie's request running")
        leaking.cancel()  # aborted before its first decode report: its slots stay held
        t_abort = time.time()
        assert done.join()[0]["tokens"] == 20
        t_done = time.time()
        assert ok.value(M.running) == 0 and ok.value(M.usage) > 0  # the prefill report's usage, stale
        window = drain_window(10.0, IDLE)
        wait_for(lambda: time.time() > max(t_done, t_abort) + window + 0.5, timeout=window + 5,
                 what="the drain window")
    finally:
        series = [s.stop() for s in samplers]
    good, bad = (s.arrays() for s in series)

    # the emulator republishes usage only at the idle report, 30 s after the prefill report
    zero = good["t"][(good["usage"] == 0) & (good["t"] > t_done)]
    assert zero.size and IDLE - 0.5 <= zero[0] - t_sent <= IDLE + 2.0, zero[:1] - t_sent

    passed = check_leak(drain_check(good, t_done, deadline_s=window, pool_units=4000, idle_report_seconds=IDLE),
                        4000, "tokens")
    assert passed.passed, passed.reason
    short = check_leak(drain_check(good, t_done, deadline_s=10.0, pool_units=4000, idle_report_seconds=IDLE),
                       4000, "tokens")
    assert short.inconclusive and "no report after it went idle was seen" in short.reason, short.reason
    leaked = check_leak(drain_check(bad, t_abort, deadline_s=window, pool_units=4000, idle_report_seconds=IDLE),
                        4000, "tokens")
    assert not leaked.passed and not leaked.inconclusive and "tokens leaked" in leaked.reason, leaked.reason
