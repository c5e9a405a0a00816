"""What a Locust process watches of its own event loop: the lag monitor, whose once-a-second records
tell the probe whether the load generator distorted a level (`kvprobe.load.health`), and the test-only
stall that makes such a distortion on purpose. Runs only inside the Locust process (gevent)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import gevent

from kvprobe.load.health import HEALTH_PERIOD, STALL_PERIOD
from kvprobe.load.records import Record

_HOST = socket.gethostname()  # named in lag records: which load host saturated


def lag_monitor(write: Callable[[Record], None], label: Callable[[], str]) -> None:
    """Oversleep of a 10 ms sleep, p99 per second, and this process's CPU in cores (the loop lag
    tracks how far the client distorts first-token times: kvprobe.load.health)."""
    lags: list[float] = []
    t_last, cpu_last = time.monotonic(), time.process_time()
    while True:
        t0 = time.perf_counter()
        gevent.sleep(0.01)
        lags.append(max(0.0, (time.perf_counter() - t0 - 0.01) * 1000.0))
        now = time.monotonic()
        if now - t_last >= HEALTH_PERIOD:
            cpu_now = time.process_time()
            lags.sort()
            p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
            write(Record(kind="lag", t=time.time(), lag_ms=round(p99, 3), lag_max_ms=round(lags[-1], 3),
                         cpu=round((cpu_now - cpu_last) / (now - t_last), 4), worker=label(), host=_HOST))
            lags = []
            t_last, cpu_last = now, cpu_now


def stall(seconds: float) -> None:
    """Tests only (kvprobe.load.health.STALL_ENV): block the whole loop for `seconds` every
    STALL_PERIOD s, with a real sleep (nothing else runs meanwhile, and no CPU is burnt on a shared
    machine), so this process's loop lag p99 reads about that long, every second."""
    from gevent import monkey

    blocking_sleep = monkey.get_original("time", "sleep")
    while True:
        gevent.sleep(STALL_PERIOD)
        blocking_sleep(seconds)
