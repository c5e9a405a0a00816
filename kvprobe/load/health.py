"""Client health: was the load generator, not the engine, setting the timing? Per load process.

Every load-generating process (a local Locust process, a `--processes` child, a `kvprobe worker` on
another host) writes one lag record a second: the p99 oversleep of a 10 ms gevent sleep and its CPU.
Loop lag tracks TTFT distortion (measured with FastHttpUser streams): 3–7 ms is healthy on this class of VM, tens of ms
means the client sets the timing. One saturated process is enough to distort the levels it served,
so the probe is judged by its worst process, and the report names it.

No gevent or Locust here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LAG_SATURATED_MS = 15.0
# A closed-loop user loses about one loop lag per request cycle (its next send waits for the loop);
# at 1% of a request's lifetime that is under 1% of the concurrency offered, which a level past its
# knee absorbs in its queue. So long requests (seconds each) tolerate a proportionally longer lag;
# LAG_SATURATED_MS stays the floor, where TTFT distortion starts.
LIFETIME_SHARE = 0.01
CPU_SATURATED = 0.9  # cores: a gevent process cannot use more than one
HEALTH_PERIOD = 1.0  # seconds: each load process writes one lag record per period (kvprobe.load.locustfile)

# Tests only: a load process that starves on purpose. With this variable set (milliseconds), each
# Locust process blocks its whole loop that long every STALL_PERIOD seconds (kvprobe.load.locustfile),
# so its loop lag reads saturated, deterministically, whatever else the machine does.
STALL_ENV = "KVPROBE_TEST_CLIENT_STALL_MS"
STALL_PERIOD = 0.05


@dataclass
class WorkerHealth:
    worker: str                 # the process's label (w<index>, or w0 for a single local process)
    host: str | None            # the load host it ran on
    cpu: float                  # mean CPU (cores)
    lag_p99_ms: float           # median over seconds of the per-second p99 loop lag
    lag_worst_ms: float         # the worst per-second p99 loop lag
    seconds: int                # lag samples the figures come from
    saturated: bool
    reason: str = ""

    @property
    def name(self) -> str:
        return f"worker {self.worker}" + (f" on {self.host}" if self.host else "")


@dataclass
class ClientHealth:
    cpu: float | None           # mean CPU (cores) of the busiest load-generating process
    cpu_total: float | None     # mean CPU (cores) of all load-generating processes together
    lag_p99_ms: float | None    # median over seconds of the per-second p99 loop lag (busiest process)
    lag_worst_ms: float | None  # the worst per-second p99 loop lag seen
    processes: int
    seconds: int                # lag samples (one per process-second) the figures come from
    saturated: bool
    reason: str = ""
    workers: list[WorkerHealth] = field(default_factory=list)  # one per load process, by label


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def _label_key(label: str) -> tuple[int, str]:
    digits = label[1:] if label[:1] == "w" else ""
    return (int(digits), label) if digits.isdigit() else (1 << 30, label)


def lag_limit_ms(lifetime_s: float | None) -> float:
    """The loop lag (ms) above which a load process sets the timing of requests lasting `lifetime_s`."""
    return max(LAG_SATURATED_MS, LIFETIME_SHARE * 1000.0 * (lifetime_s or 0.0))


def median_lifetime(records: list, t0: float | None = None, t1: float | None = None) -> float | None:
    """The median seconds from send to end of the completed requests sent in [t0, t1]."""
    spans = [r.t_end - r.t_send for r in records
             if r.ok and r.t_send is not None and r.t_end is not None
             and (t0 is None or r.t_send >= t0) and (t1 is None or r.t_send <= t1)]
    return _median(spans) if spans else None


def worker_health(worker: str, lag_records: list, *, lag_limit: float = LAG_SATURATED_MS) -> WorkerHealth:
    cpu = sum(r.cpu or 0.0 for r in lag_records) / len(lag_records)
    lag = _median([r.lag_ms or 0.0 for r in lag_records])
    host = next((r.host for r in reversed(lag_records) if r.host), None)
    h = WorkerHealth(worker, host, cpu, lag, max(r.lag_ms or 0.0 for r in lag_records), len(lag_records), False)
    reasons = []
    if lag > lag_limit:
        reasons.append(f"loop lag p99 {lag:.1f} ms > {lag_limit:.3g} ms")
    if cpu > CPU_SATURATED:
        reasons.append(f"a load process used {cpu:.2f} cores (> {CPU_SATURATED:g})")
    h.saturated = bool(reasons)
    h.reason = "; ".join(reasons) or "healthy"
    return h


def client_health(records: list, t0: float | None = None, t1: float | None = None) -> ClientHealth:
    """Summarise the lag records of the load-generating processes (not the master) in [t0, t1],
    against the lag limit of the requests sent there (`lag_limit_ms`)."""
    limit = lag_limit_ms(median_lifetime(records, t0, t1))
    by_worker: dict[str, list] = {}
    for r in records:
        if r.kind == "lag" and r.worker != "master" and (t0 is None or (r.t or 0) >= t0) and \
                (t1 is None or (r.t or 0) <= t1):
            by_worker.setdefault(r.worker or "?", []).append(r)
    if not by_worker:
        return ClientHealth(None, None, None, None, 0, 0, False, "no loop-lag records")
    workers = [worker_health(w, rs, lag_limit=limit)
               for w, rs in sorted(by_worker.items(), key=lambda kv: _label_key(kv[0]))]
    h = ClientHealth(cpu=max(w.cpu for w in workers), cpu_total=sum(w.cpu for w in workers),
                     lag_p99_ms=max(w.lag_p99_ms for w in workers), lag_worst_ms=max(w.lag_worst_ms for w in workers),
                     processes=len(workers), seconds=sum(w.seconds for w in workers), saturated=False, workers=workers)
    bad = [w for w in workers if w.saturated]
    h.saturated = bool(bad)
    if not bad:
        h.reason = "client healthy"
    elif len(workers) == 1:
        h.reason = bad[0].reason  # one process: nothing to name
    else:
        h.reason = "; ".join(f"{w.name}: {w.reason}" for w in bad) + f" ({len(bad)} of {len(workers)} load processes)"
    return h
