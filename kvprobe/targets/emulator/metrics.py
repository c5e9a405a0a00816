"""/metrics of the emulator, through prometheus_client, in each engine's exact names, types and labels.

Gauges are written when the real engine writes them: vLLM after every step's update_from_output;
SGLang at prefill batches, every decode_log_interval decode batches and on idle (at once when the
running gauge is stale, else every 30 s: the loop wakes for it). Counters and histograms move when
their event happens. Names, labels and buckets come from the dialect module. The emulator adds its
own `kvprobe_emulator_*` families (step lag, true pool usage).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvprobe.engines import sglang as sg
from kvprobe.engines import vllm as vl

vm, sm = vl.METRICS, sg.METRICS  # every metric name is the dialect module's
TRUE_RUNNING = "kvprobe_emulator_running"  # the emulator's own family: its true running count


@dataclass
class Snapshot:
    """The scheduler state as the engine's gauges would show it (after fault hooks)."""

    running: int
    waiting: int
    usage: float  # the engine's own gauge definition (0..1)
    used_tokens: int
    pool_tokens: int
    preemptions_total: int
    prefix_queries_total: int = 0
    prefix_hits_total: int = 0
    new_token_ratio: float = 0.0
    true_usage: float = 0.0  # what the pool really holds (differs from `usage` under a gauge fault)
    swa_used_tokens: int = 0  # SGLang hybrid SWA: the window pool's used tokens and its size (0: none)
    swa_pool_tokens: int = 0


class _View:
    """A registry view: without `_created` samples (SGLang serves the multiprocess collector, which has
    none) and/or without some families (faults, vLLM --disable-log-stats)."""

    def __init__(self, registry: CollectorRegistry, *, no_created: bool, drop=frozenset(), drop_prefix=None):
        self._registry, self.no_created, self.drop, self.drop_prefix = registry, no_created, drop, drop_prefix

    def collect(self):
        for metric in self._registry.collect():
            if metric.name in self.drop or (self.drop_prefix and metric.name.startswith(self.drop_prefix)):
                continue
            if self.no_created:
                metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
                if not metric.samples:
                    continue  # the multiprocess collector prints no family that was never written
            yield metric


class _Base:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lag_gauge = Gauge("kvprobe_emulator_step_lag_seconds",
                               "How far the engine loop is behind the emulator's time model (after the last step).",
                               registry=r)
        self.lag_total = Counter("kvprobe_emulator_lag_seconds",
                                 "Real time given up behind the time model "
                                 "(lag = (d this + d step_lag_seconds) / d model_seconds).",
                                 registry=r)
        self.model_total = Counter("kvprobe_emulator_model_seconds", "Modelled engine-step time.", registry=r)
        self.steps_total = Counter("kvprobe_emulator_steps", "Engine steps run.", registry=r)
        self.true_usage = Gauge("kvprobe_emulator_pool_usage",
                                "Fraction of the real pool held by requests (not the engine's gauge).", registry=r)
        # The engine's own count after every step, whatever its dialect publishes (SGLang samples):
        # the reference the plateau benchmark measures against.
        self.true_running = Gauge(TRUE_RUNNING,
                                  "Requests in the running batch after the last step (not the engine's gauge).",
                                  registry=r)
        self._last: dict[str, float] = {}

    def on_lag(self, lag_s: float, lost_s: float, model_s: float) -> None:
        self.lag_gauge.set(lag_s)
        if lost_s > 0:
            self.lag_total.inc(lost_s)
        self.model_total.inc(model_s)
        self.steps_total.inc()

    def _delta(self, key: str, total: float) -> float:
        prev = self._last.get(key, 0.0)
        self._last[key] = total
        return max(0.0, total - prev)

    NO_CREATED = False

    def exposition(self, drop: frozenset[str] = frozenset(), drop_prefix: str | None = None) -> bytes:
        """The text /metrics serves; `drop` family names and families starting with `drop_prefix` left out."""
        if not drop and not drop_prefix and not self.NO_CREATED:
            return generate_latest(self.registry)
        return generate_latest(_View(self.registry, no_created=self.NO_CREATED, drop=drop, drop_prefix=drop_prefix))


class VllmMetrics(_Base):
    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, model_name: str, cache_labels: dict[str, str]):
        super().__init__()
        r, ln, h = self.registry, list(vl.LABELS), vl.HELP
        lv = {"model_name": model_name, "engine": "0"}

        def gauge(name, extra=()):
            return Gauge(name, h[name], ln + list(extra), registry=r)

        def counter(name, extra=()):
            return Counter(name, h[name], ln + list(extra), registry=r)

        self.running = gauge(vm.running).labels(**lv)
        self.waiting = gauge(vm.waiting).labels(**lv)
        by_reason = gauge(vm.waiting_capacity[0], ["reason"])
        self.waiting_capacity = by_reason.labels(**lv, reason="capacity")
        by_reason.labels(**lv, reason="deferred").set(0)
        sleep = gauge(vm.extra["sleep_state"], ["sleep_state"])
        for state in vl.SLEEP_STATES:
            sleep.labels(**lv, sleep_state=state).set(1 if state == "awake" else 0)
        self.usage = gauge(vm.usage).labels(**lv)
        self.prefix_queries = counter(vm.extra["prefix_queries"]).labels(**lv)
        self.prefix_hits = counter(vm.extra["prefix_hits"]).labels(**lv)
        self.preemptions = counter(vm.preemptions).labels(**lv)
        self.prompt_tokens = counter(vm.extra["prompt_tokens"]).labels(**lv)
        self.generation_tokens = counter(vm.extra["generation_tokens"]).labels(**lv)
        success = counter(vm.success, ["finished_reason"])
        self.success = {reason: success.labels(**lv, finished_reason=reason) for reason in vl.FINISHED_REASONS}
        self.ttft = Histogram(vm.ttft, h[vm.ttft], ln,
                              buckets=vl.TTFT_BUCKETS, registry=r).labels(**lv)
        self.e2e = Histogram(vm.extra["e2e"], h[vm.extra["e2e"]], ln,
                             buckets=vl.E2E_BUCKETS, registry=r).labels(**lv)
        info = Gauge(vm.extra["cache_config"], h[vm.extra["cache_config"]], sorted(cache_labels), registry=r)
        info.labels(**cache_labels).set(1)

    def publish(self, s: Snapshot) -> None:
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.waiting_capacity.set(s.waiting)  # no deferral reasons are emulated
        self.usage.set(s.usage)
        self.true_usage.set(s.true_usage)
        self.preemptions.inc(self._delta("pre", s.preemptions_total))
        self.prefix_queries.inc(self._delta("pq", s.prefix_queries_total))
        self.prefix_hits.inc(self._delta("ph", s.prefix_hits_total))

    def on_step(self, s: Snapshot, *, prefill_tokens: int, decode_seqs: int, emitted: int, now: float) -> None:
        """vLLM records scheduler stats at the end of every update_from_output (scheduler.py L2660-2674)."""
        self.prompt_tokens.inc(prefill_tokens)
        self.generation_tokens.inc(emitted)
        self.publish(s)
        self.true_running.set(s.running)

    def on_idle(self, s: Snapshot, now: float) -> None:
        self.publish(s)
        self.true_running.set(s.running)

    def idle_report_due(self, now: float) -> float | None:
        return None  # the last step's record already shows the idle engine

    def on_first_token(self, ttft: float, stream: bool) -> None:
        self.ttft.observe(ttft)

    def on_finished(self, reason: str, e2e: float, stream: bool, prompt_tokens: int = 0,
                    completion_tokens: int = 0) -> None:
        self.success.get(reason, self.success["error"]).inc()
        if reason != "abort":
            self.e2e.observe(e2e)


class SglangMetrics(_Base):
    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
    NO_CREATED = True

    def __init__(self, model_name: str, *, max_total_num_tokens: int, context_len: int, page_size: int,
                 decode_log_interval: int = sg.DECODE_LOG_INTERVAL, swa_pool_tokens: int | None = None,
                 mamba_slots: int | None = None):
        super().__init__()
        r, ln, h = self.registry, list(sg.LABELS), sg.HELP
        lv = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        self._tok = {"model_name": model_name, "engine_type": "unified"}

        def gauge(name, extra=()):
            return Gauge(name, h.get(name, name), ln + list(extra), registry=r)

        self.running = gauge(sm.running).labels(**lv)
        self.queue = gauge(sm.waiting).labels(**lv)
        self.usage = gauge(sm.usage).labels(**lv)
        self.used = gauge(sm.used_tokens).labels(**lv)
        self.kv_used = gauge(sm.extra["kv_used_tokens"]).labels(**lv)
        self.kv_available = gauge(sm.extra["kv_available_tokens"]).labels(**lv)
        self.kv_evictable = gauge(sm.extra["kv_evictable_tokens"]).labels(**lv)
        self.ratio = gauge(sm.extra["new_token_ratio"]).labels(**lv)
        # Per-pool gauges, on every model (0 where the pool does not exist), as PoolStats fills them
        # (pool_stats_observer.py L150-163): token_usage is the larger of the full and window usage.
        hm = sg.HYBRID_METRICS
        self.pool_gauges = {role: gauge(hm[role]).labels(**lv) for role in hm if role != "swa_pool_tokens"}
        self.mamba_slots = mamba_slots  # recurrent-state slots (radix cache off: one per running request)
        # no multiprocess_mode -> "all" mode adds a pid label (fixture: pid="1607")
        self.retracted_gauge = gauge(sm.extra["retracted_gauge"], ["pid"]).labels(**lv, pid=str(os.getpid()))
        # The retraction counter's child is created at the first retraction (metrics_collector.py
        # L557-562, L1519, 0.5.23): until then sglang:num_retracted_requests_total is not on /metrics.
        self._retracted_family = Counter(sm.preemptions, h[sm.preemptions], ln, registry=r)
        self._labels_sched = lv
        for name, value in ((sm.pool_tokens, max_total_num_tokens), (sm.extra["page_size"], page_size),
                            (sm.extra["num_pages"], max_total_num_tokens // page_size),
                            (sm.extra["context_len"], context_len)):
            gauge(name).labels(**lv).set(value)  # emit_constants, once at startup
        if swa_pool_tokens is not None:  # emitted only for a window pool (emit_constants L1782-1784)
            gauge(sg.HYBRID_METRICS["swa_pool_tokens"]).labels(**lv).set(swa_pool_tokens)
        tl = list(sg.TOKENIZER_LABELS) + ["is_streaming"]
        self.ttft = Histogram(sm.ttft, h[sm.ttft], tl,
                              buckets=sg.TTFT_BUCKETS, registry=r)
        self.e2e = Histogram(sm.extra["e2e"], h[sm.extra["e2e"]], tl,
                             buckets=sg.E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(sm.extra["prompt_tokens"], h[sm.extra["prompt_tokens"]], tl, registry=r)
        self.generation_tokens = Counter(sm.extra["generation_tokens"], h[sm.extra["generation_tokens"]], tl,
                                         registry=r)
        self.requests = Counter(sm.success, h[sm.success], tl, registry=r)
        self.interval = decode_log_interval
        self._decode_steps = 0
        self._prev_running = 0
        self._reported_running: int | None = None
        self._reported_at = 0.0
        self._pending_tokens = (0, 0)

    def publish(self, s: Snapshot, *, running: int | None = None, now: float = 0.0) -> None:
        running = s.running if running is None else running
        self.running.set(running)
        self.queue.set(s.waiting)
        swa_usage = s.swa_used_tokens / s.swa_pool_tokens if s.swa_pool_tokens else 0.0
        # PoolStats: token_usage rounded to 2 places (a hybrid's is the larger pool usage, which the
        # scheduler's own usage already is: theory/sglang/swa/scheduler.py); num_used_tokens the larger used count;
        # kv_* the full pool's (pool_stats_observer.py L84-92, L150-163)
        self.usage.set(round(s.usage, 2))
        self.used.set(max(s.used_tokens, s.swa_used_tokens))
        self.pool_gauges["full_usage"].set(s.used_tokens / s.pool_tokens if s.pool_tokens else 0.0)
        if self.mamba_slots:  # `_get_mamba_token_info` (pool_stats_observer.py L262-303), nothing evictable;
            # slots are held from admission (this pass's included), unlike the running gauge's count
            self.pool_gauges["mamba_usage"].set(s.running / self.mamba_slots)
            self.pool_gauges["mamba_used_slots"].set(s.running)
            self.pool_gauges["mamba_available_slots"].set(self.mamba_slots - s.running)
        if s.swa_pool_tokens:
            self.pool_gauges["swa_usage"].set(swa_usage)
            self.pool_gauges["swa_used_tokens"].set(s.swa_used_tokens)
            self.pool_gauges["swa_available_tokens"].set(s.swa_pool_tokens - s.swa_used_tokens)
        self.kv_used.set(s.used_tokens)
        self.kv_available.set(max(0, s.pool_tokens - s.used_tokens))
        self.kv_evictable.set(0)
        self.ratio.set(s.new_token_ratio)
        self.true_usage.set(s.true_usage)
        retracted = self._delta("ret", s.preemptions_total)
        self.retracted_gauge.set(retracted)  # "number retracted since the last report"
        if retracted:
            self._retracted_family.labels(**self._labels_sched).inc(retracted)
        self._reported_running = running  # what the gauge shows, so on_idle sees a stale one
        self._reported_at = now

    def on_step(self, s: Snapshot, *, prefill_tokens: int, decode_seqs: int, emitted: int, now: float) -> None:
        if prefill_tokens > 0:
            # PrefillStats.from_adder: the running count *before* this pass's new requests
            self.publish(s, running=self._prev_running, now=now)
        elif decode_seqs > 0:
            self._decode_steps += 1
            if self._decode_steps % self.interval == 0:
                self.publish(s, now=now)
        self._prev_running = s.running
        self.true_running.set(s.running)

    def on_idle(self, s: Snapshot, now: float) -> None:
        # `_maybe_log_idle_metrics` (engines/sglang/metrics.py IDLE_REPORT_SECONDS): at once only when the
        # running gauge is stale; usage and the queue may wait out the interval
        if self._reported_running != s.running or now - self._reported_at >= sg.IDLE_REPORT_SECONDS:
            self.publish(s, now=now)
        self._prev_running = s.running
        self.true_running.set(s.running)

    def idle_report_due(self, now: float) -> float | None:
        """Seconds until an idle engine republishes its gauges (the loop wakes for it)."""
        return max(0.0, self._reported_at + sg.IDLE_REPORT_SECONDS - now)

    def _labels(self, stream: bool) -> dict[str, str]:
        return {**self._tok, "is_streaming": "true" if stream else "false"}

    def on_first_token(self, ttft: float, stream: bool) -> None:
        self.ttft.labels(**self._labels(stream)).observe(ttft)

    def on_finished(self, reason: str, e2e: float, stream: bool, prompt_tokens: int = 0,
                    completion_tokens: int = 0) -> None:
        lab = self._labels(stream)
        self.requests.labels(**lab).inc()
        self.prompt_tokens.labels(**lab).inc(prompt_tokens)
        self.generation_tokens.labels(**lab).inc(completion_tokens)
        if reason != "abort":
            self.e2e.labels(**lab).observe(e2e)
