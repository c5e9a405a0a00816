"""What SGLang's usage gauge shows in a closed loop: `sglang:token_usage` as the scheduler publishes it.

SGLang 0.5.23 writes its scheduler gauges only at reports, and each holds until the next:
- a prefill report for every prefill batch, from `process_batch_result_prefill`
  (srt/managers/scheduler_components/batch_result_processor.py, `report_prefill_stats`), i.e. after
  the batch ran: the new requests' prompt KV is allocated and the requests that finished before it
  are already released (radix cache on: evictable, which the gauge counts as free);
- a decode report every `--decode-log-interval` decode batches (metrics_reporter.py
  `report_decode_stats`: `forward_ct_decode % decode_log_interval`);
- with the overlap scheduler (the default) a batch's result is processed after the next batch was
  launched (scheduler.py `event_loop_overlap`), so every report also holds that batch's one
  decode slot per running request.
Usage is `(M - available - evictable) / M` (pool_stats_observer.py), rounded to 2 places.

So the gauge is not the pool's time average: it holds the reading of the last report, and in a
closed loop the prefill reports come right after a request's replacement was admitted with its
prompt only, the lowest point of the cycle (`sglang_published_usage`). The emulator publishes at
the same moments (targets/emulator/metrics.py).
"""

from __future__ import annotations

# srt/arg_groups/fields/observability.py `decode_log_interval` (0.5.23): decode batches between
# decode reports, the engine's default
DECODE_LOG_INTERVAL = 40


def reported_growth(d: float, interval: int) -> float:
    """∫₀ᵈ E[decode step of the last report, or 0] dx over a cycle of d decode steps that starts at a
    prefill report, with decode reports every `interval` decode steps at a phase unrelated to the
    cycle's: within the first `interval` steps a report has come with probability x / interval, at a
    uniform step before x; after that one always has, on average interval / 2 steps ago. Times the
    R slots a decode step adds, it is how far the gauge rose above the prefill report's reading."""
    if d <= interval:
        return d ** 3 / (6 * interval)
    return interval ** 2 / 6 + (d * d - interval * interval) / 2 - interval * (d - interval) / 2


def sglang_published_usage(running: int, P: int, O: int, M: int, decode_log_interval: int = DECODE_LOG_INTERVAL,  # noqa: E741
                           shared: int = 0, overlap: bool = True) -> float:
    """The time average of sglang:token_usage with `running` (R) requests admitted in a closed loop of
    fixed-length requests (P prompt, O output tokens) whose phases are spread, as real clients leave
    them (each one's round trip staggers the next admission; the zero-latency simulated loop can lock
    into cohorts instead, so its own gauge is not used here).

    Every request lives O − 1 decode steps, and R of them finish and are replaced in that time: a
    cycle of one prefill batch and d = (O − 1) / R decode steps. The prefill report reads the new
    request's prompt and the R − 1 others, spread over their lives (on average (O − 1) / 2 tokens
    generated): the lowest point of the cycle, held until a decode report. The pool then grows by
    R slots a decode step, which the gauge shows only at decode reports (`reported_growth`). With
    the overlap scheduler every report also counts the next batch's R decode slots. `shared` prompt
    tokens (a cached prefix) are held once for all. (The peak physical usage, R × (P + O − 1) / M,
    is what the dashboard never shows.)"""
    R = running
    if R <= 0:
        return 0.0
    own = P - shared
    at_prefill = (R - 1) * (own + (O - 1) / 2) + own + shared + (R if overlap else 0)
    d = (O - 1) / R
    return round((at_prefill + R * reported_growth(d, decode_log_interval) / (d + 1)) / M, 2)
