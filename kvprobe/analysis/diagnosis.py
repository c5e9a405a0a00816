"""Which limit stopped admission, read from the signatures the measurement leaves.

Pure functions over what the probe gathered (levels, the rejection point, client health, what the
engine reports, the expectation's scheduler config); no I/O. Each signature gives a one-line
reason naming the limit and, where the engine reports its configuration, the flag whose value
differs from the expectation:

- client:  the load generator saturated (loop lag / CPU): said first, as a caveat on the rest;
- none:    no level saturated the engine;
- stuck:   running falls at higher load while requests wait: admission stopped for good;
- request cap: an integer ceiling on running with KV free and no preemption (`max_num_seqs`,
  `max_running_requests`);
- token budget: a plateau at budget × O / (P + O) with KV free and no preemption;
- kv / pool smaller: KV near its predicted saturation level, or preemptions/retractions — below
  the prediction that means the real pool is smaller than reported;
- unknown: admission stops with KV free and no preemption at no limit kvprobe knows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvprobe.theory.prediction import judged_plateau

PINNED = 0.15  # running within this of an integer on every weighted level: pinned by a count
KV_MARGIN = 0.10  # usage at least predicted-saturation minus this (or 2 x usage_gap): KV is full


@dataclass
class Diagnosis:
    limit: str  # none | stuck | max_num_seqs / max_running_requests | token_budget | kv | pool | unknown
    reason: str  # one line, naming the limit
    flag: str | None = None  # the engine flag of that limit
    expected: object = None  # its value in the expectation (the ledger's scheduler config)
    reported: object = None  # its value as the engine reports it (None: not reported)
    client_saturated: bool = False  # the load generator was the bottleneck: a caveat on all of it

    @property
    def kv_binds(self) -> bool:
        return self.limit in ("kv", "pool")


def _config_value(config, flag: str | None):
    """The expectation's value of `flag`: the theory's scheduler config names its fields after it."""
    field = None if flag is None or config is None else flag.replace("-", "_")
    return getattr(config, field) if field in getattr(config, "__dataclass_fields__", {}) else None


def _pct(x) -> str:
    return "—" if x is None else f"{x:.0%}"


def _preemptions(levels) -> float | None:
    seen = [lv.preemptions for lv in levels if lv.preemptions is not None]
    return float(sum(seen)) if seen else None


def pinned_count(levels, weights: dict[int, float], output_tokens: int | None = None) -> int | None:
    """The integer K when a count caps running: no level that weighs in the plateau ever reads
    above K, and the levels carrying two thirds of the weight read K at their highest and sit just
    below it on average — a finished request's slot stays empty until the next step admits a
    waiting one, about one step in O + 1, so a cap of K reads K(1 − 1/(O + 1)) on a per-step gauge
    (15.5 for 16 at O = 32; 16.0 at O = 256). Where running is the client's count (a sampled
    gauge), its mean within that slack of the gauge's highest reading is the evidence."""
    used = [lv for lv in levels if weights.get(lv.users, 0) > 0]
    highs = [lv.engine_running_max if lv.engine_running_max is not None else lv.running_max for lv in used]
    if not used or not all(h is not None and np.isfinite(h) for h in highs):
        return None
    k = int(round(max(highs)))
    if k < 1 or abs(max(highs) - k) > 1e-9:
        return None
    slack = max(0.75, 2 * k / (output_tokens + 1)) if output_tokens else 0.75

    def held(lv, high) -> bool:
        if lv.running_source == "client":
            # a sampled gauge may miss the full batch at a level (K is the highest it ever read), and
            # the streams overlap a handover step: the client's mean sits within the slack either side
            return k - slack <= lv.running_mean <= k + slack
        return abs(high - k) < 1e-9 and k - slack <= lv.running_mean <= k + PINNED

    weight = sum(weights[lv.users] for lv, h in zip(used, highs, strict=True) if held(lv, h))
    return k if weight >= 2 / 3 * sum(weights[lv.users] for lv in used) else None


def diagnose(*, prediction, rejection, levels, allowance: float, usage_tol: float, client=None,
             reported=None, config=None, dialect=None, prompt_tokens: int | None = None,
             output_tokens: int | None = None, reported_agrees: bool | None = None) -> Diagnosis:
    """The limit the measurement shows (see the module doc), judged against `prediction`. A
    saturated client is said first: what the levels show may then be the client's limit."""
    found = _signature(prediction=prediction, rejection=rejection, levels=levels, allowance=allowance,
                       usage_tol=usage_tol, reported=reported, config=config, dialect=dialect,
                       prompt_tokens=prompt_tokens, output_tokens=output_tokens, reported_agrees=reported_agrees)
    if client is not None and client.saturated:
        found.client_saturated = True
        found.reason = (f"the load generator saturated ({client.reason}), so the engine was not measured "
                        f"reliably; the levels show: {found.reason}")
    return found


def _signature(*, prediction, rejection, levels, allowance, usage_tol, reported, config, dialect,
               prompt_tokens, output_tokens, reported_agrees) -> Diagnosis:
    if rejection is None or rejection.rejection_point is None:
        top = max(rejection.levels_seen, default=None) if rejection is not None else None
        return Diagnosis("none", "no level saturated the engine (waiting never persisted)"
                         + (f"; highest level {top}" if top else ""))
    measured, predicted = rejection.rejection_point, judged_plateau(prediction)
    saturated = [lv for lv in levels if lv.users in set(rejection.saturated_levels)]
    stuck = _stuck(levels, rejection, predicted)
    if stuck is not None:
        return stuck
    usage = rejection.usage_at_rejection
    preemptions = _preemptions(saturated)
    preempting = bool(preemptions)
    signs = f"KV {_pct(usage)} used, " + ("no preemption" if preemptions == 0 else
                                          "preemption counter absent" if preemptions is None else
                                          f"{preemptions:g} preemptions")
    agrees = abs(measured - predicted) <= allowance
    if agrees and prediction.binding != "kv":  # a cap or the budget, where the ledger put it
        return Diagnosis(prediction.binding, f"{prediction.binding} binds as predicted ({signs})")
    # KV's saturation level is the prediction's gauge reading only where the ledger has KV binding
    kv_full = (prediction.binding == "kv" and usage is not None
               and usage >= prediction.usage_at_limit - max(KV_MARGIN, 2 * usage_tol))
    if not preempting and not kv_full:
        cap = pinned_count(saturated, rejection.weights, output_tokens)
        engine_cap = reported.max_running if reported is not None else None
        # A ceiling below the cap the engine reports is some other limit (a step budget holds an
        # integer count too): the reported cap rules the request cap out.
        if cap is not None and engine_cap in (None, cap) and not agrees:
            return _request_cap(cap, measured, signs, config, reported, dialect)
        budget = None if agrees else _token_budget(measured, allowance, signs, config, reported, dialect,
                                                    prompt_tokens, output_tokens)
        if budget is not None:
            return budget
        if not agrees:
            return Diagnosis("unknown", f"admission stops at {measured:.2f} running with {signs}: a limit other "
                                        "than KV binds, and it is neither a request cap nor the token budget")
    if kv_full or preempting:
        if measured < predicted - allowance and reported_agrees is not False:
            return Diagnosis("pool", f"KV fills at {measured:.2f} running ({signs}), below the {predicted:g} the "
                                     "pool allows: the engine's real pool is smaller than reported, or it "
                                     "reserves more per request than its policy says")
        return Diagnosis("kv", f"KV binds ({signs})")
    return Diagnosis(prediction.binding, f"{prediction.binding} binds as predicted ({signs})")


def _stuck(levels, rejection, predicted: float) -> Diagnosis | None:
    """Running falls at higher load and stays down while requests wait: the two deepest levels
    run at least max(2, 20%) fewer requests than the best level before them."""
    usable = sorted((lv for lv in levels if lv.users in set(rejection.levels_seen)), key=lambda lv: lv.users)
    if len(usable) < 3:
        return None
    drop = max(2.0, 0.2 * predicted)
    peak = max(usable[:-2], key=lambda lv: lv.running_mean)
    last = usable[-1]
    if all(lv.running_mean < peak.running_mean - drop and lv.users in rejection.saturated_levels
           for lv in usable[-2:]):
        return Diagnosis("stuck", f"admission stopped for good: running fell from {peak.running_mean:.1f} at "
                                  f"N={peak.users} to {last.running_mean:.1f} at N={last.users} while "
                                  f"{last.waiting_mean:.1f} requests waited")
    return None


def _request_cap(cap: int, measured: float, signs: str, config, reported, dialect) -> Diagnosis:
    flag = (dialect.REQUEST_CAP_FLAG if dialect is not None else None) or "request-cap"
    name = flag.replace("-", "_")
    expected = _config_value(config, flag)
    got = reported.max_running if reported is not None else None
    head = (f"a request cap binds at {cap}: running held at {measured:.2f}, never above {cap}, on every saturated "
            f"level with {signs}")
    if got is not None and got != expected:
        tail = f"; the engine reports {name}={got}, the expectation says {expected}"
    elif got is None and expected is not None and cap != expected:
        tail = (f"; the expectation says {name}={expected}, the engine runs as if it were {cap} "
                f"(it does not report {name} here)")
    else:
        tail = f" ({name}={cap})"
    return Diagnosis(name, head + tail, flag=flag, expected=expected, reported=got)


def _token_budget(measured, allowance, signs, config, reported, dialect, prompt_tokens, output_tokens):
    """Each step decodes the running requests and prefills the next ones' prompts: running can
    reach at most budget × O / (P + O) when the budget binds."""
    flag = dialect.TOKEN_BUDGET_FLAG if dialect is not None else None
    if flag is None or not prompt_tokens or not output_tokens:
        return None
    name = flag.replace("-", "_")
    expected = _config_value(config, flag)
    got = reported.token_budget if reported is not None else None
    for budget in (got, expected):
        if budget and budget > 0:
            # a throughput bound, not a count: steps that prefill a chunk decode too, so allow 15%
            bound = budget * output_tokens / (prompt_tokens + output_tokens)
            if abs(measured - bound) <= max(allowance, 0.15 * bound):
                differs = (f"; the engine reports {name}={got}, the expectation says {expected}"
                           if got is not None and got != expected else "")
                return Diagnosis("token_budget", f"the per-step token budget binds: {name}={budget} holds "
                                                 f"{bound:.1f} running at P={prompt_tokens}, O={output_tokens} "
                                                 f"({signs}){differs}", flag=flag, expected=expected, reported=got)
    return None
