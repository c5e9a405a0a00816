"""Faults: documented shapes of real admission bugs and misleading dashboards, as thin hooks.

The policy is never forked: every request still goes through schedsim's scheduler. A fault only
changes what reaches it (`add`/`abort`), what happens to the pool around it, or what /metrics and
the reported capacity say. `--fault NAME` or `--fault NAME=VALUE`, repeatable:

- `zombie-blocks`: blocks (SGLang: token slots) of an *aborted* request are never returned to the
  pool (seed 000 §4.3: usage creeps up, never drains to 0 after load; capacity shrinks over time).
- `gauge-written-only[=SECONDS]`: the usage gauge counts only full blocks of *prompt* KV of running
  requests (not generated tokens, not the partial last block) and is refreshed every SECONDS
  (default 1.0): the dashboard reads low and late while requests queue (seed 000's "26%").
- `stuck-admission`: once the pool was full (a request had to wait while the running cap had room
  and nothing was admitted, or a preemption/retraction happened) admission stops for good: waiting
  requests are never admitted again, running drains to 0, waiting stays up (the shape of vllm-project/vllm#53130).
- `underreported-pool[=FACTOR]`: the scheduler's real pool is FACTOR (default 0.75) of what the
  startup log, `vllm:cache_config_info` / `sglang:max_total_num_tokens` and /server_info report.
- `metrics-garbage`: /metrics answers 200 (with the engine's content type) but the body is not
  Prometheus exposition (an HTML error page, as a proxy or a crashed exporter in front of it serves):
  `prometheus_client.parser` raises on it. Scheduling is untouched.
- `metrics-drop-after[=SECONDS]`: after SECONDS (default 3.0) of serving, the running, waiting and usage
  families (the dialect's MetricMap running/waiting/usage and the waiting-by-reason gauge) vanish from
  /metrics; every other family stays (an exporter restarted without them, or a relabelling rule that
  drops them halfway through a probe). Scheduling is untouched.
"""

from __future__ import annotations

from kvprobe.errors import ConfigError
from kvprobe.targets.emulator.metrics import Snapshot

FAULTS = {
    "zombie-blocks": None,
    "gauge-written-only": 1.0,
    "stuck-admission": None,
    "underreported-pool": 0.75,
    "metrics-garbage": None,
    "metrics-drop-after": 3.0,
}
GARBAGE_METRICS = (b"<html><head><title>502 Bad Gateway</title></head>\n"
                   b"<body><h1>502 Bad Gateway</h1><p>upstream exporter unavailable</p></body></html>\n")
STUCK_STEPS = 2  # consecutive steps with waiting, room under the running cap and no admission


def parse_faults(values: list[str] | None) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for raw in values or []:
        name, _, arg = raw.partition("=")
        if name not in FAULTS:
            raise ConfigError(f"unknown fault {name!r}: expected one of {', '.join(FAULTS)}", key="--fault")
        value = FAULTS[name]
        if arg:
            try:
                value = float(arg)
            except ValueError:
                raise ConfigError(f"fault {name}: expected a number after '=', got {arg!r}", key="--fault") from None
        if name == "underreported-pool" and not 0 < (value or 0) <= 1:
            raise ConfigError(f"fault underreported-pool: expected a factor in (0, 1], got {value}", key="--fault")
        if name == "metrics-drop-after" and (value or 0) < 0:
            raise ConfigError(f"fault metrics-drop-after: expected seconds >= 0, got {value}", key="--fault")
        out[name] = value
    return out


def dropped_families(faults: dict[str, float | None], metric_map, serving_for: float | None) -> frozenset[str]:
    """Families /metrics leaves out now under `metrics-drop-after` (`serving_for`: seconds since start)."""
    after = faults.get("metrics-drop-after")
    if after is None or serving_for is None or serving_for < after:
        return frozenset()
    names = {metric_map.running, metric_map.waiting, metric_map.usage, *metric_map.usage_fallbacks}
    if metric_map.waiting_capacity is not None:
        names.add(metric_map.waiting_capacity[0])
    return frozenset(names)


def real_pool(reported: int, faults: dict[str, float | None], minimum: int = 2) -> int:
    """The pool the scheduler really gets for the `reported` one."""
    if "underreported-pool" in faults:
        return max(minimum, int(reported * faults["underreported-pool"]))
    return reported


class Hooks:
    """Sits between the runtime and the scheduler; with no faults it only forwards."""

    def __init__(self, scheduler, faults: dict[str, float | None], *, running_cap: int, unit: int, clock):
        self.s, self.faults, self.cap, self.unit, self.clock = scheduler, faults, running_cap, unit, clock
        self.leaked = 0  # blocks (vLLM) / token slots (SGLang) held by zombies
        self.held: dict[str, object] = {}  # stuck-admission: requests never given to the scheduler
        self.stuck = False
        self._quiet_steps = 0
        self.written: dict[str, int] = {}  # gauge-written-only: rid -> prompt tokens of running requests
        self._gauge = (0.0, -1e18)  # (value, computed at)

    # --- traffic
    def add(self, req) -> None:
        if self.stuck:
            self.held[req.rid] = req
        else:
            self.s.add(req)

    def abort(self, rid: str) -> None:
        self.written.pop(rid, None)
        if self.held.pop(rid, None) is not None:
            return
        if "zombie-blocks" not in self.faults:
            self.s.abort(rid)
            return
        pool = self.s.pool
        before = self._free(pool)
        self.s.abort(rid)
        freed = self._free(pool) - before
        if freed > 0:  # take the freed capacity back and never return it
            if hasattr(pool, "take"):
                pool.take(freed)
            else:
                pool.alloc(freed)
            self.leaked += freed
            self.s.refresh_stats()  # the gauges must show the blocks it took

    @staticmethod
    def _free(pool) -> int:
        return pool.num_free if hasattr(pool, "num_free") else pool.available + pool.evictable

    # --- after each step
    def after_step(self, result) -> None:
        if "gauge-written-only" in self.faults:
            for req, _ in result.emitted:
                self.written.setdefault(req.rid, len(req.prompt))
            for req in list(result.finished) + list(result.preempted):
                self.written.pop(req.rid, None)
        if "stuck-admission" in self.faults and not self.stuck:
            st = self.s.stats
            quiet = st.waiting > 0 and 0 < st.running < self.cap and result.prefill_tokens == 0
            self._quiet_steps = self._quiet_steps + 1 if quiet else 0
            if result.preempted or self._quiet_steps >= STUCK_STEPS:
                self._trip()

    def _trip(self) -> None:
        self.stuck = True
        for req in list(self.s.waiting):
            self.s.abort(req.rid)
            self.held[req.rid] = req

    # --- what the engine reports
    def snapshot(self) -> Snapshot:
        st = self.s.stats
        pool_tokens = max(1, st.pool_tokens)
        true_usage = st.used_tokens / pool_tokens
        usage = st.usage
        if "gauge-written-only" in self.faults:
            now, (value, at) = self.clock(), self._gauge
            if now - at >= self.faults["gauge-written-only"]:
                written = sum(p // self.unit * self.unit for p in self.written.values())
                value = min(1.0, written / pool_tokens)
                self._gauge = (value, now)
            usage = value
        return Snapshot(running=st.running, waiting=st.waiting + len(self.held), usage=usage,
                        used_tokens=st.used_tokens, pool_tokens=st.pool_tokens,
                        preemptions_total=st.preemptions_total, prefix_queries_total=st.prefix_queries_total,
                        prefix_hits_total=st.prefix_hits_total, new_token_ratio=st.new_token_ratio or 0.0,
                        true_usage=true_usage, swa_used_tokens=st.swa_used_tokens,
                        swa_pool_tokens=st.swa_pool_tokens)
