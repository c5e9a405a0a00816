"""The engine's own figures in what a person reads: the lines a configuration's engine will print
about its pool (the ledger), and the engine's claim beside the ledger and the measurement (a
probe). The arithmetic and the reasons are `kvprobe.verdict.claim`'s; the wording of each release's
lines is its dialect's (`claim_lines`)."""

from __future__ import annotations

from kvprobe.engines import get_dialect
from kvprobe.verdict.claim import Figures, claim_from_reported, engine_claim, figures

LEDGER_SOURCE = "the lines above"


def hybrid_groups(capacity: dict) -> str | None:
    """The names of a hybrid model's KV cache groups or pools, or None for one pool."""
    groups = [g.get("group") for g in capacity.get("groups") or () if g.get("group")]
    return ", ".join(groups) if len(groups) > 1 else None


def _rejection_tolerance(exp) -> tuple[float, float]:
    tol = exp.tolerances
    return tol.rejection_point, tol.rejection_point_relative


def ledger_figures(led) -> Figures | None:
    """The engine's claim as the ledger predicts it, held against the ledger's limit (None without a
    request shape or when the engine would refuse to start)."""
    if led.refusal is not None or led.admission is None or led.request is None:
        return None
    cap, inp = led.capacity, led.inputs
    claim = engine_claim(inp.engine, cap.kv_tokens, cap.max_running, led.request.prompt_tokens,
                         led.request.output_tokens, LEDGER_SOURCE)
    groups = hybrid_groups({"groups": cap.groups}) or hybrid_groups({"groups": led.request.groups})
    return figures(claim, ledger_limit=led.admission.limit, binding=led.admission.binding, hybrid=groups,
                   cap_given=getattr(inp, "max_running_requests", None) if inp.engine == "sglang" else None)


def ledger_claim_lines(led) -> list[str]:
    """The lines the engine will print or publish about its pool, in its release's wording."""
    if led.refusal is not None:
        return []
    return get_dialect(led.inputs.engine).claim_lines(led.to_dict()["capacity"], led.engine_version)


def ledger_claim_text(led) -> str:
    """The engine's own lines about its pool, in its release's wording, then the claim for the
    request shape when there is one."""
    if led.refusal is not None:
        return ""
    lines = [f"what {led.inputs.engine} {led.engine_version} will say about its pool:"]
    lines += [f"  {text}" for text in ledger_claim_lines(led)]
    fig = ledger_figures(led)
    if fig is not None:
        lines.append(fig.line())
    return "\n".join(lines)


def probe_figures(result) -> Figures | None:
    """The engine's claim (what it reported), the ledger's limit and the measured rejection point."""
    exp, ledger = result.expectation, result.ledger or {}
    facts = result.facts
    if facts is None or not ledger.get("capacity"):
        return None
    shape = exp.profile.request
    claim = claim_from_reported(exp.engine, facts.reported, shape.prompt_tokens, shape.output_tokens)
    admission = ledger.get("admission") or {}
    check = next((c for c in result.checks if c.name == "rejection_point"), None)
    cap_given = exp.flags.get(get_dialect(exp.engine).REQUEST_CAP_FLAG) if exp.engine == "sglang" else None
    groups = hybrid_groups(ledger["capacity"]) or hybrid_groups(ledger.get("request") or {})
    return figures(claim, ledger_limit=admission.get("limit"), binding=admission.get("binding"),
                   measured=None if check is None else check.measured,
                   uncertainty=None if check is None else check.uncertainty, hybrid=groups,
                   cap_given=cap_given if isinstance(cap_given, int) else None,
                   tolerance=_rejection_tolerance(exp))
