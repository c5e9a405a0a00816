"""Sample an engine's /metrics into a time series of one schema for both dialects.

Schema (`Sample`): running, waiting, waiting_capacity, usage, preemptions, used_tokens. Names come
from the dialect's `MetricMap`; the text is parsed with prometheus_client's own parser. A metric
the engine does not export is `None` (NaN in arrays), never 0: "no data" and "zero" are different
findings. A failed scrape is a sample with `ok=False` and the reason, so gaps stay visible.

`Sample.t` is wall-clock (`time.time()`), the clock the load generator's subprocesses also write
in their request and level records.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvprobe.engines.base import MetricMap
from kvprobe.observe.http import http_get, redact_url

FIELDS = ("running", "waiting", "waiting_capacity", "usage", "preemptions", "used_tokens")
REQUIRED = ("running", "waiting")  # without these a sample says nothing about admission


@dataclass
class Sample:
    t: float
    ok: bool
    running: float | None = None
    waiting: float | None = None
    waiting_capacity: float | None = None
    usage: float | None = None
    preemptions: float | None = None
    used_tokens: float | None = None
    error: str | None = None


@dataclass
class TimeSeries:
    samples: list[Sample] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)

    def append(self, sample: Sample) -> None:
        self.samples.append(sample)

    def arrays(self) -> dict[str, np.ndarray]:
        """t, the schema fields (float64, NaN where missing) and ok (bool)."""
        samples = list(self.samples)  # a snapshot: the sampler thread may be appending
        out = {"t": np.array([s.t for s in samples], dtype=float)}
        for name in FIELDS:
            out[name] = np.array([_nan(getattr(s, name)) for s in samples], dtype=float)
        out["ok"] = np.array([s.ok for s in samples], dtype=bool)
        return out

    def to_jsonl(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            for s in list(self.samples):
                row = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(s).items()}
                fh.write(json.dumps(row, separators=(",", ":")) + "\n")

    @classmethod
    def from_jsonl(cls, path: str | Path) -> TimeSeries:
        series = cls()
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    series.append(Sample(**json.loads(line)))
        return series


def _nan(v: float | None) -> float:
    return math.nan if v is None else float(v)


# --------------------------------------------------------------------------- parsing


def _base(name: str) -> str:
    """Family key tolerant of the counter suffix: `x_total` and `x` are the same family.

    prometheus_client names a typed counter family `x` (series `x_total`); an untyped one, or a
    `# TYPE x_total counter` line (SGLang's multiprocess output), keeps `x_total`.
    """
    return name[: -len("_total")] if name.endswith("_total") else name


def _index(text: str) -> dict[str, list]:
    """family key -> the value series of that family (histogram/`_created` series left out)."""
    index: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        key = _base(family.name)
        for s in family.samples:
            if _base(s.name) == key:  # drops x_created, x_bucket, x_sum, x_count
                index.setdefault(key, []).append(s)
    return index


def _values(index: dict[str, list], name: str | None, labels: dict[str, str] | None = None) -> list[float] | None:
    if name is None:
        return None
    series = index.get(_base(name))
    if series is None:
        return None
    if labels:
        series = [s for s in series if all(s.labels.get(k) == v for k, v in labels.items())]
    vals = [s.value for s in series if not math.isnan(s.value)]
    return vals or None


def _sum(vals: list[float] | None) -> float | None:
    return None if vals is None else float(sum(vals))


def _mean(vals: list[float] | None) -> float | None:
    # A 0..1 gauge with one series per engine/rank: the mean is the pool-wide fraction for equal
    # pools; a sum would read 2.0 for two full ranks.
    return None if vals is None else float(sum(vals) / len(vals))


def parse_sample(text: str, metrics: MetricMap, t: float) -> Sample:
    """One /metrics text -> Sample. Extra labels are summed over (usage: averaged)."""
    try:
        index = _index(text)
    except Exception as err:  # the parser raises ValueError, IndexError, ... on garbage
        return Sample(t=t, ok=False, error=f"unparseable /metrics text: {type(err).__name__}: {err}"[:300])
    usage = None
    for name in (metrics.usage, *metrics.usage_fallbacks):
        usage = _mean(_values(index, name))
        if usage is not None:
            break
    waiting_capacity = None
    if metrics.waiting_capacity is not None:
        family, labels = metrics.waiting_capacity
        waiting_capacity = _sum(_values(index, family, labels))
    sample = Sample(
        t=t, ok=True,
        running=_sum(_values(index, metrics.running)),
        waiting=_sum(_values(index, metrics.waiting)),
        waiting_capacity=waiting_capacity,
        usage=usage,
        preemptions=_sum(_values(index, metrics.preemptions)),
        used_tokens=_sum(_values(index, metrics.used_tokens)),
    )
    missing = [getattr(metrics, f) for f in REQUIRED if getattr(sample, f) is None]
    if missing:
        sample.ok = False
        sample.error = "missing metrics: " + ", ".join(missing)
    return sample


def metrics_url(url: str) -> str:
    """A base URL gets /metrics appended; a URL already ending in /metrics is kept."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def scrape_once(url: str, metrics: MetricMap, headers: dict[str, str] | None = None,
                timeout: float = 2.0) -> tuple[str, Sample]:
    """GET /metrics once. Any failure is an ok=False sample with the reason, never an exception."""
    target = metrics_url(url)
    shown = redact_url(target)
    t0 = time.time()
    try:
        status, body = http_get(target, headers=headers, timeout=timeout)
    except (OSError, urllib.error.URLError, ValueError) as err:
        reason = err.reason if isinstance(err, urllib.error.URLError) else err
        return "", Sample(t=(t0 + time.time()) / 2, ok=False, error=f"GET {shown}: {type(reason).__name__}: {reason}")
    t = (t0 + time.time()) / 2  # the gauges were read somewhere between request and response
    text = body.decode("utf-8", "replace")
    if status != 200:
        return text, Sample(t=t, ok=False, error=f"GET {shown}: HTTP {status}")
    return text, parse_sample(text, metrics, t)


# --------------------------------------------------------------------------- the sampler thread


class Sampler:
    """Scrapes /metrics every `interval` s on a plain thread (urllib; no gevent, no asyncio).

    Ticks are on a fixed grid from start(); a scrape that overruns skips the missed ticks instead
    of bursting to catch up.
    """

    def __init__(self, url: str, metrics: MetricMap, *, interval: float = 0.1,
                 headers: dict[str, str] | None = None, timeout: float = 2.0):
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.url = metrics_url(url)
        self.metrics = metrics
        self.interval = interval
        self.timeout = timeout
        self._headers = dict(headers or {})
        self.series = TimeSeries()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:  # headers may carry an API key: never shown
        return f"Sampler({redact_url(self.url)!r}, interval={self.interval}, samples={len(self.series)})"

    def start(self) -> Sampler:
        if self._thread is not None:
            raise RuntimeError("Sampler already started")
        self._thread = threading.Thread(target=self._run, name="kvprobe-sampler", daemon=True)
        self._thread.start()
        return self

    def tick(self) -> Sample:
        """One scrape, appended to the series (a fleet sampler scrapes every replica here)."""
        sample = self._scrape(self.url)
        self.series.append(sample)
        return sample

    def _scrape(self, url: str) -> Sample:
        try:
            return scrape_once(url, self.metrics, self._headers, self.timeout)[1]
        except Exception as err:  # a sampler bug must show up in the series, not kill the thread
            return Sample(t=time.time(), ok=False, error=f"sampler: {type(err).__name__}: {err}")

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
        """The first new sample satisfying `predicate` within `timeout` s, else None."""
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
        """Stop and join (deadline: one scrape timeout + one interval + 1 s); returns the series."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout if timeout is not None else 2 * self.timeout + self.interval + 1.0)
        return self.series

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
