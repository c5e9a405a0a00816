"""Every replica's /metrics on one tick: the fleet's series (what the probe's analysis reads) and
each replica's own (what the per-replica figures and checks read).

The fleet sample is the sum of the replicas' running, waiting, preemptions and used tokens and the
mean of their usage gauges (identical pools: the mean is the fleet's fraction), read on the same
tick so a request moving between two replicas' counts is never counted twice for long. A tick is
ok only when every replica answered: a fleet sum with a replica missing would read as a drop.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kvprobe.engines.base import MetricMap
from kvprobe.observe import Sample, TimeSeries, metrics_url, scrape_once

SUMMED = ("running", "waiting", "waiting_capacity", "preemptions", "used_tokens")


def combine(samples: list[Sample]) -> Sample:
    """The fleet's sample from one tick of the replicas' samples."""
    t = sum(s.t for s in samples) / len(samples)
    bad = [f"replica {i}: {s.error}" for i, s in enumerate(samples) if not s.ok]
    if bad:
        return Sample(t=t, ok=False, error="; ".join(bad)[:300])
    out = Sample(t=t, ok=True)
    for name in SUMMED:
        vals = [getattr(s, name) for s in samples]
        setattr(out, name, None if any(v is None for v in vals) else float(sum(vals)))
    usage = [s.usage for s in samples]
    out.usage = None if any(u is None for u in usage) else float(sum(usage) / len(usage))
    return out


class FleetSampler:
    """The `observe.Sampler` interface (start, stop, series, latest, wait_for, running) over R
    replicas; `replica_series[i]` holds replica i's own samples, tick for tick with `series`."""

    def __init__(self, urls: list[str], metrics: MetricMap, *, interval: float = 0.1,
                 headers: dict[str, str] | None = None, timeout: float = 2.0):
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        if not urls:
            raise ValueError("a fleet sampler needs at least one replica URL")
        self.urls = [metrics_url(u) for u in urls]
        self.metrics = metrics
        self.interval = interval
        self.timeout = timeout
        self._headers = dict(headers or {})
        self.series = TimeSeries()
        self.replica_series = [TimeSeries() for _ in urls]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="kvprobe-fleet-scrape")

    def __repr__(self) -> str:
        return f"FleetSampler({len(self.urls)} replicas, interval={self.interval}, samples={len(self.series)})"

    def start(self) -> FleetSampler:
        if self._thread is not None:
            raise RuntimeError("FleetSampler already started")
        self._thread = threading.Thread(target=self._run, name="kvprobe-fleet-sampler", daemon=True)
        self._thread.start()
        return self

    def _scrape(self, url: str) -> Sample:
        try:
            return scrape_once(url, self.metrics, self._headers, self.timeout)[1]
        except Exception as err:  # a sampler bug must show up in the series, not kill the thread
            return Sample(t=time.time(), ok=False, error=f"sampler: {type(err).__name__}: {err}")

    def tick(self) -> Sample:
        """Scrape every replica at once (threads: a slow replica does not skew the others' times)."""
        samples = list(self._pool.map(self._scrape, self.urls))
        for series, s in zip(self.replica_series, samples, strict=True):
            series.append(s)
        fleet = combine(samples)
        self.series.append(fleet)
        return fleet

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            self.tick()
            next_tick += self.interval
            now = time.monotonic()
            if next_tick < now:
                next_tick = now + self.interval - (now - next_tick) % self.interval
            self._stop.wait(next_tick - now)

    def latest(self) -> Sample | None:
        return self.series.samples[-1] if self.series.samples else None

    def wait_for(self, predicate, timeout: float) -> Sample | None:
        deadline = time.monotonic() + timeout
        seen = len(self.series)
        while time.monotonic() < deadline:
            samples = self.series.samples
            for s in samples[seen:]:
                if predicate(s):
                    return s
            seen = len(samples)
            time.sleep(min(self.interval / 2, 0.05))
        return None

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> TimeSeries:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout if timeout is not None else 2 * self.timeout + self.interval + 1.0)
        self._pool.shutdown(wait=True)
        return self.series

    def __enter__(self) -> FleetSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
