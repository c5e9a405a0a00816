"""Every replica's /metrics on one tick: the fleet's series (what the probe's analysis reads) and
each replica's own (what the per-replica figures and checks read).

The fleet sample is the sum of the replicas' running, waiting, preemptions and used tokens and the
mean of their usage gauges (identical pools: the mean is the fleet's fraction), read on the same
tick so a request moving between two replicas' counts is never counted twice for long. A tick is
ok only when every replica answered: a fleet sum with a replica missing would read as a drop.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from kvprobe.engines.base import MetricMap
from kvprobe.observe.sampler import Sample, Sampler, TimeSeries, metrics_url

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


class FleetSampler(Sampler):
    """`observe.Sampler` over R replicas: its tick scrapes them all; `series` is the fleet's sum and
    `replica_series[i]` holds replica i's own samples, tick for tick with `series`."""

    def __init__(self, urls: list[str], metrics: MetricMap, *, interval: float = 0.1,
                 headers: dict[str, str] | None = None, timeout: float = 2.0):
        if not urls:
            raise ValueError("a fleet sampler needs at least one replica URL")
        super().__init__(urls[0], metrics, interval=interval, headers=headers, timeout=timeout)
        self.urls = [metrics_url(u) for u in urls]
        self.replica_series = [TimeSeries() for _ in urls]
        self._pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="kvprobe-fleet-scrape")

    def __repr__(self) -> str:
        return f"FleetSampler({len(self.urls)} replicas, interval={self.interval}, samples={len(self.series)})"

    def tick(self) -> Sample:
        """Scrape every replica at once (threads: a slow replica does not skew the others' times)."""
        samples = list(self._pool.map(self._scrape, self.urls))
        for series, s in zip(self.replica_series, samples, strict=True):
            series.append(s)
        fleet = combine(samples)
        self.series.append(fleet)
        return fleet

    def stop(self, timeout: float | None = None) -> TimeSeries:
        series = super().stop(timeout)
        self._pool.shutdown(wait=True)
        return series
