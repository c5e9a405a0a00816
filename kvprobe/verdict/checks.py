"""Checks: one prediction, the engine's own report and one measurement, side by side, judged.

Each check function takes what the probe gathered and returns a `CheckResult`. A check that
cannot be judged (no /metrics, the client was the bottleneck, the binding limit is not KV) says
so in `reason` and is marked `inconclusive`, which fails the check: a probe must never pass
by not measuring.

Each check function is declared with `@check(name, reads_load=...)`: whether it judges figures
the load produced (the levels' running, queue, usage, preemptions). When the load generator was
the bottleneck those figures are the client's, not the engine's, and `unjudged_if_starved` leaves
every such check inconclusive with one reason; a check that reads only the engine's own report,
the drain after the load, or each response's content is judged as usual.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvprobe.theory.prediction import judged_plateau


@dataclass
class CheckResult:
    name: str
    predicted: object = None
    reported: object = None
    measured: object = None
    binding: str | None = None
    passed: bool = False
    inconclusive: bool = False
    reason: str = ""
    tolerance: str = ""
    uncertainty: float | None = None  # ± half-width (~95%) of `measured`, where it has one
    diagnosis: str | None = None  # the limit the measurement shows (kvprobe.analysis.diagnosis), where read

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def status(self) -> str:
        if self.inconclusive:
            return "INCONCLUSIVE"
        return "PASS" if self.passed else "FAIL"


READS_LOAD: dict[str, bool] = {}  # check name -> judged on the load's figures (filled by @check)


def check(name: str, *, reads_load: bool):
    """Declare a check function: the name of the check it returns, and whether it reads the load."""
    def declare(fn):
        READS_LOAD[name] = reads_load
        return fn
    return declare


def unjudged_if_starved(res: CheckResult, starvation) -> CheckResult:
    """A check that reads the load, when the load generator was the bottleneck
    (`kvprobe.analysis.client.Starvation`): inconclusive, whatever it measured — a starved client
    shows its own limit, which must neither pass nor fail the engine. Its figures stay for the record."""
    if starvation is None or not READS_LOAD[res.name]:
        return res
    res.passed, res.inconclusive = False, True
    res.reason = f"the load generator was the bottleneck, not the engine ({starvation.reason})"
    return res


def within(measured: float, predicted: float, *, absolute: float, relative: float) -> tuple[bool, float]:
    """True when |measured − predicted| ≤ max(absolute, relative × predicted); returns the allowance."""
    allowance = max(absolute, relative * abs(predicted))
    return abs(measured - predicted) <= allowance + 1e-9, allowance


def fmt(value: object) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


# --- the checks -----------------------------------------------------------------------------


@check("reported_capacity", reads_load=False)
def check_reported_capacity(ledger: dict, reported, tol: float) -> CheckResult:
    """The pool the engine says it built versus the ledger's pool (blocks for vLLM, tokens for SGLang)."""
    cap = ledger["capacity"]
    pairs = [("num_blocks", cap.get("num_blocks"), reported.num_blocks),
             ("kv_tokens", cap.get("kv_tokens"), reported.kv_tokens)]
    judged = [(name, p, r) for name, p, r in pairs if p is not None and r is not None]
    res = CheckResult("reported_capacity", tolerance=f"±{tol:.1%}")
    if not judged:
        res.inconclusive = True
        res.reason = "the engine reported no pool size (no startup line, cache_config_info or max_total_num_tokens)"
        return res
    name, predicted, got = judged[0]
    res.predicted, res.reported, res.measured = predicted, got, got
    bad = [(n, p, r) for n, p, r in judged if abs(r - p) > tol * max(abs(p), 1)]
    res.passed = not bad
    if bad:
        n, p, r = bad[0]
        res.reason = f"engine reports {n}={r}, ledger predicts {p} ({(r - p) / max(p, 1):+.1%})"
    else:
        res.reason = f"engine reports {name}={got}, ledger predicts {predicted}"
    return res


def _judged_against(prediction, implied, reported_agrees):
    """The prediction a measurement of *admission* is judged against. When the engine built a pool
    of another size than the ledger's (reported_capacity fails — memory profiling on a real GPU
    can differ from any estimate), admission is judged against what the engine's own reported pool
    implies under the same policy, so one sizing error is not reported twice."""
    if reported_agrees is False and implied is not None:
        return implied, "the engine's reported pool"
    return prediction, "the ledger"


@check("rejection_point", reads_load=True)
def check_rejection_point(prediction, rejection, tol, *, reported_agrees: bool | None = None, implied=None,
                          diagnosis=None, disagreeing=()) -> CheckResult:
    """The measured running plateau where waiting starts versus the predicted admission limit —
    the running it holds on average (`theory.prediction.judged_plateau`), as the plateau is a time average.

    The plateau comes with an uncertainty (a ~95% half-width, `rejection.uncertainty`); the check
    uses it both ways, so a tight tolerance is honest: it FAILS when the prediction lies outside
    the tolerance even allowing for that uncertainty, PASSES when the measurement is inside the
    tolerance and precise enough to say so (uncertainty within the tolerance), and is otherwise
    INCONCLUSIVE — as it is when the plateau rests on too few deep levels (`rejection.confirmed`).
    Levels of the plateau where the client's count and a sampled gauge disagree are named.
    """
    target, source = _judged_against(prediction, implied, reported_agrees)
    res = CheckResult(
        "rejection_point",
        predicted=round(float(prediction.limit), 2),
        reported=None if implied is None else round(float(implied.limit), 2),
        binding=target.binding,
        tolerance=f"±max({tol.rejection_point:g}, {tol.rejection_point_relative:.0%})",
    )
    if rejection.rejection_point is None:
        res.inconclusive = True
        top = max(rejection.levels_seen, default=None)
        res.reason = ("no level saturated the engine (waiting never persisted)"
                      + (f"; highest level {top}" if top else ""))
        return res
    res.measured = round(float(rejection.rejection_point), 2)
    half = rejection.uncertainty
    res.uncertainty = None if half is None else round(float(half), 2)
    expected, most = round(judged_plateau(target), 2), round(float(target.limit), 2)
    allowance = max(tol.rejection_point, tol.rejection_point_relative * abs(expected))
    diff = abs(res.measured - expected)
    shown = f"{res.measured:g}" + ("" if half is None else f" ± {half:.2f}")
    predicts = f"{expected:g}" if expected == most else f"{most:g} at once, {expected:g} on average"
    head = f"running plateaus at {shown} while requests wait; {source} predicts {predicts} ({target.binding} binds)"
    stuck = diagnosis is not None and diagnosis.limit == "stuck"
    if not stuck and not rejection.confirmed:
        # One level that looks saturated may be a measurement artefact (a last level read low):
        # it can neither pass nor fail the engine.
        res.inconclusive = True
        deep = rejection.deep_levels
        res.reason = (f"{head}, but the plateau rests on {len(deep)} deep level(s) {deep or ''} — levels where at "
                      f"least {rejection.deep_waiting or 0:.1f} requests wait are needed to confirm it")
    elif stuck or diff - (half or 0.0) > allowance + 1e-9:
        res.reason = f"{head}, outside ±{allowance:.2g}; " + (
            diagnosis.reason if diagnosis is not None else
            _diagnose(res.measured, expected, rejection, True if target is implied else reported_agrees))
    elif half is None or half > allowance or diff > allowance + 1e-9:
        res.inconclusive = True
        res.reason = (f"{head}: the measurement's uncertainty straddles the tolerance ±{allowance:.2g} "
                      "(hold levels longer or add deep levels)")
    else:
        res.passed = True
        res.reason = f"{head}, within ±{allowance:.2g}"
    if diagnosis is not None and not res.passed and diagnosis.reason not in res.reason:
        res.reason += f"; measured: {diagnosis.reason}"
    if disagreeing:  # reported, not resolved: the plateau used the client's count at these levels
        res.reason += "; the client's count and the engine's sampled gauge disagree at " + ", ".join(
            f"N={lv.users} ({lv.running_mean:.2f} vs {lv.engine_running_mean:.2f})" for lv in disagreeing)
    if diagnosis is not None:
        res.diagnosis = diagnosis.limit
    return res


def _diagnose(measured: float, predicted: float, rejection, reported_agrees: bool | None) -> str:
    """Which of the three numbers disagrees, when no signature was read: our theory, the engine's
    pool, or its admission."""
    spread = rejection.plateau_spread or 0.0
    if measured < predicted and spread > max(2.0, 0.2 * predicted):
        return f"running collapses at higher load (plateau spread {spread:.1f}): admission stopped for good"
    if measured < predicted and reported_agrees:
        return ("the engine admits fewer requests than the pool it reports allows: its real pool "
                "is smaller than reported, or it reserves more per request than its policy says")
    if reported_agrees is False:
        return "the engine sized its pool differently from the ledger (see reported_capacity)"
    return "the engine admits more than its pool and policy allow" if measured > predicted else \
        "the engine admits fewer than its pool and policy allow"


@check("no_preemption", reads_load=True)
def check_no_preemption(prediction, rejection, tol, *, reported_agrees: bool | None = None,
                        implied=None, diagnosis=None, unpredicted=()) -> CheckResult:
    """The largest N served with no waiting and no preemption versus the predicted bound, and no
    preemption at all at the levels where the policy predicts none (`unpredicted`: (N, preemptions
    measured) at levels whose simulated steady state never preempts). A policy that admits a
    request only when it fits to the end (vLLM 0.33's full-ISL admission with a long prompt) never
    preempts even while requests wait; an engine that preempts there admits more than fits."""
    target, source = _judged_against(prediction, implied, reported_agrees)
    res = CheckResult("no_preemption", predicted=prediction.no_preemption_limit,
                      reported=None if implied is None else implied.no_preemption_limit,
                      binding=target.binding, tolerance=f"±{tol.rejection_point:g}")
    if rejection.last_clean_users is None:
        res.inconclusive = True
        res.reason = "no level ran clean (every level waited or preempted)"
        return res
    res.measured = rejection.last_clean_users
    # Real-time arrivals are staggered, so the clean region may extend past the in-phase bound
    # up to the plateau; only running out of room *before* the bound is a failure.
    low = target.no_preemption_limit - tol.rejection_point
    res.passed = res.measured >= low
    waited = f" (requests waited from N={rejection.onset_users})" if rejection.onset_users else ""
    res.reason = (
        f"clean up to N={res.measured}{waited}; {source} guarantees clean up to {target.no_preemption_limit}"
        + ("" if res.passed else " — the engine queued or preempted earlier than its pool allows")
    )
    if unpredicted:
        res.passed = False
        seen = ", ".join(f"N={n} ({count:g})" for n, count in unpredicted)
        res.reason += (f"; but the engine preempted at {seen}, where the ledger's policy ({prediction.policy}) "
                       "preempts nothing: it admits requests its pool cannot carry to completion")
    if diagnosis is not None:
        res.diagnosis = diagnosis.limit
        if not res.passed and not diagnosis.kv_binds:
            res.reason += f"; measured: {diagnosis.reason}"
    return res


def stale_gauges(drain) -> str:
    """Why an undrained reading is no leak yet: the engine's idle report was not watched for."""
    return (f"the engine republishes its gauges only every {drain.idle_report_seconds:g}s when idle and the drain "
            f"was watched {drain.watched or 0:.1f}s: no report after it went idle was seen")


@check("leak", reads_load=False)
def check_leak(drain, pool_units: int | None, unit: str) -> CheckResult:
    """After the load stops, running, waiting and usage must return to zero — as the engine's idle
    report shows them: a reading older than that report (SGLang's idle gauges) is inconclusive."""
    res = CheckResult("leak", predicted=0, tolerance="0")
    if drain is None or not drain.samples:
        res.inconclusive = True
        res.reason = "no /metrics samples after the load stopped: the drain cannot be watched"
        return res
    res.measured = drain.residual_usage
    res.passed = bool(drain.drained)
    if res.passed:
        res.reason = f"drained to zero in {drain.time_to_zero:.1f}s"
    elif drain.stale:
        res.inconclusive = True
        res.reason = (f"usage still read {fmt(drain.residual_usage)} {drain.watched:.1f}s after the load stopped, "
                      f"but {stale_gauges(drain)}")
    else:
        leaked = drain.leaked_blocks_estimate
        res.reason = (
            f"usage stayed at {fmt(drain.residual_usage)} (running {fmt(drain.residual_running)}, waiting "
            f"{fmt(drain.residual_waiting)}) after the load stopped"
            + (f": ≈{leaked} {unit} leaked" if leaked else "")
        )
    return res


@check("usage_gap", reads_load=True)
def check_usage_gap(prediction, rejection, tol: float, *, reported_agrees: bool | None = None,
                    implied=None, diagnosis=None) -> CheckResult:
    """What the dashboard gauge read at the moment admission stopped, next to the predicted value.
    When a limit other than KV stopped admission, the gauge reads what that limit lets in: the
    reason names the limit instead of blaming the dashboard."""
    target, source = _judged_against(prediction, implied, reported_agrees)
    res = CheckResult("usage_gap", predicted=round(prediction.usage_at_limit, 3),
                      reported=None if implied is None else round(implied.usage_at_limit, 3), tolerance=f"±{tol:g}")
    if rejection.usage_at_rejection is None:
        res.inconclusive = True
        res.reason = ("admission never stopped, so there is no gauge reading at the stop"
                      if rejection.rejection_point is None else "the engine exports no usage gauge")
        return res
    expected = round(target.usage_at_limit, 3)
    res.measured = round(float(rejection.usage_at_rejection), 3)
    res.passed = abs(res.measured - expected) <= tol + 1e-9
    res.reason = f"the usage gauge read {res.measured:.0%} when admission stopped; {source} predicts {expected:.0%}"
    if diagnosis is not None:
        res.diagnosis = diagnosis.limit
    if res.passed:
        return res
    if diagnosis is None or diagnosis.kv_binds or diagnosis.limit == prediction.binding:
        res.reason += " — the dashboard misreports the pool"
    else:
        res.reason += f" — KV did not stop admission: {diagnosis.reason}"
    return res


@check("exactness", reads_load=False)
def check_exactness(records, prompt_tokens: int, output_tokens: int) -> CheckResult:
    """Every response's usage equals P and O exactly; one mismatch fails the probe."""
    from kvprobe.load.records import ABORTED, USAGE_MISMATCH

    done = [r for r in records if r.kind == "request" and r.status == 200]
    mismatched = [r for r in records if r.kind == "request" and r.status == USAGE_MISMATCH]
    # streams cut by a ramp-down or the stop are not the engine's errors
    errors = [r for r in records if r.kind == "request" and r.status not in (200, USAGE_MISMATCH, ABORTED)]
    res = CheckResult("exactness", predicted=f"{prompt_tokens}/{output_tokens}", tolerance="exact")
    res.measured = f"{len(done)} exact, {len(mismatched)} mismatched, {len(errors)} errors"
    if mismatched:
        r = mismatched[0]
        res.reason = (f"usage {r.prompt_tokens}/{r.completion_tokens} != {prompt_tokens}/{output_tokens} "
                      f"({len(mismatched)} requests)")
    elif not done:
        res.inconclusive = True
        res.reason = "no request completed"
    elif errors:
        res.reason = f"{len(errors)} requests failed, first: {errors[0].status} {errors[0].error or ''}".strip()
    else:
        res.passed = True
        res.reason = f"all {len(done)} completed requests returned exactly {prompt_tokens}/{output_tokens} tokens"
    return res


@check("length_limit", reads_load=False)
def check_length_limit(shot, expected_status: int, limit_desc: str) -> CheckResult:
    """A request one token past the length limit is refused as the engine documents it."""
    res = CheckResult("length_limit", predicted=expected_status, binding="length")
    if shot is None:
        res.inconclusive = True
        res.reason = "no length limit known for this engine configuration"
        return res
    res.measured = shot.status
    res.passed = shot.status == expected_status
    res.reason = (f"{limit_desc}: engine answered {shot.status}"
                  + ("" if res.passed else f", expected {expected_status}"))
    return res
