"""`kvprobe diff`: one expectation's probe on several releases of its engine, and what changed.

Each release runs the probe `kvprobe probe` runs (`run_probe`), with only `version` replaced: the
emulator plays that release's admission policy, a shadow target runs that release's engine
environment. From each result the diff keeps what a release change moves (`release_figures`): the
start-up or the refusal, the pool, the ledger's prediction and the rule it applied, the rejection
point with its uncertainty, preemptions at the deep levels (per 1k engine steps, the unit of the
ledger's simulated rate, beside the count per level), the usage gauge at saturation and the
binding limit. Between consecutive releases every figure that moved beyond the expectation's
tolerance is a change (`find_changes`); it is explained when the ledger's own figure, under each
release's rules, moved the same way beyond the same tolerance, and named with the rule that changed.
With each release run several times (`repeat`), a change must show between every run of one release
and every run of the next, and what moved between one release's own runs is reported as its noise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvprobe.errors import ConfigError, KvprobeError
from kvprobe.probe.diff_changes import find_changes, find_noise
from kvprobe.probe.diff_explain import memory_figures
from kvprobe.releases import normalize_version

# Exit codes: 0 nothing changed beyond tolerance, 1 something did, 2 bad input, 3 a release's probe
# could not measure (and nothing changed among the rest), as `kvprobe probe` uses them.
CHANGED, UNCHANGED, NOT_MEASURED = 1, 0, 3


@dataclass
class DiffOptions:
    artifacts_dir: Path
    install: bool = False  # build a missing shadow engine environment instead of refusing
    tolerances: dict[str, float] = field(default_factory=dict)
    budget_seconds: float | None = None
    profile: str | None = None
    repeat: int = 1  # runs per release, in a row: what moves between them is the measurement's own spread
    log: Callable[[str], None] = lambda line: None


@dataclass
class DiffResult:
    versions: list[str]  # one label per release run, in order (a version given twice: `0.33.0#2`)
    results: dict[str, dict]
    changes: list[dict]
    repeat: int = 1  # runs per release (`versions` holds each release's runs in a row)
    noise: list[dict] = field(default_factory=list)  # figures that moved between one release's own runs

    @property
    def exit_code(self) -> int:
        if self.changes:
            return CHANGED
        if any(r["status"] == "error" for r in self.results.values()):
            return NOT_MEASURED
        return UNCHANGED

    def to_dict(self) -> dict:
        return {"versions": self.versions, "results": self.results, "changes": self.changes,
                "repeat": self.repeat, "noise": self.noise}


def parse_versions(text: str) -> list[str]:
    """`0.11.0,0.33.0` -> the versions, in order; at least two."""
    versions = [v.strip() for v in str(text).split(",")]
    if len(versions) < 2 or not all(versions):
        raise ConfigError(f"expected two or more comma-separated versions (A,B[,C...]), got {text!r}",
                          key="--versions")
    return versions


def labels(versions: list[str]) -> list[str]:
    """One label per run: the version, and `#2`, `#3` for a version given again (its own artifacts)."""
    out, seen = [], {}
    for v in versions:
        seen[v] = seen.get(v, 0) + 1
        out.append(v if seen[v] == 1 else f"{v}#{seen[v]}")
    return out


def check_release(exp, version: str, *, install: bool = False, log=print) -> str:
    """The version normalized, once kvprobe can run this expectation on it: a release kvprobe has
    facts for, and for a shadow target its engine environment (built first with `install`)."""
    from kvprobe.engines import get_dialect

    if exp.policy is not None:
        raise ConfigError(f"expected no `policy:` in an expectation run on several releases (each release's own "
                          f"rule is what the diff compares), got {exp.policy!r}", file=exp.path, key="policy")
    v = normalize_version(version)
    known = get_dialect(exp.engine).KNOWN_VERSIONS
    if v not in known:
        raise ConfigError(f"expected {exp.engine} versions kvprobe has facts for ({', '.join(known)}), got "
                          f"{version!r}", key="--versions")
    if exp.target.mode == "shadow":
        _check_environment(exp.engine, v, install=install, log=log)
    return v


def _check_environment(engine: str, version: str, *, install: bool, log) -> None:
    from kvprobe.targets.shadow import envs, recipes

    try:
        recipes.recipe(engine, version)
    except ConfigError as err:
        raise ConfigError(f"expected a release with a shadow engine environment for the expectation's "
                          f"`target: {{launch: shadow}}`: {err}", key="--versions") from None
    if envs.find(engine, version) is not None:
        return
    if install:
        envs.install(engine, version, log=log)
        return
    try:
        envs.require(engine, version)
    except envs.EnvError as err:
        raise envs.EnvError(f"{err}, or give --install") from None


def with_version(exp, version: str, label: str | None = None):
    """The same expectation on another release (its ledger and its target follow the version);
    with a label, named after it (`NAME@0.11.0`: its own probe and artifacts in pytest)."""
    name = exp.name if label is None else f"{exp.name}@{label}"
    return dataclasses.replace(exp, version=normalize_version(version), name=name, versions=(), expect_change=(),
                               repeat=1)


def run_diff(exp, versions: list[str], options: DiffOptions) -> DiffResult:
    """Every release checked first (nothing is launched for a bad one), then probed in order."""
    from kvprobe.probe.run import apply_overrides

    if options.repeat < 1:
        raise ConfigError(f"expected a whole number of runs per release >= 1, got {options.repeat}", key="--repeat")
    checked = [check_release(exp, v, install=options.install, log=options.log) for v in versions]
    checked = [v for v in checked for _ in range(options.repeat)]
    runs = labels(checked)
    results = {}
    for label, version in zip(runs, checked, strict=True):
        run = "" if label == version else f" (run {label})"
        options.log(f"kvprobe diff: {exp.name} on {exp.engine} {version}{run}")
        results[label] = run_release(with_version(exp, version), options, Path(options.artifacts_dir) / label)
    tol = apply_overrides(exp, _probe_options(options, Path(options.artifacts_dir))).tolerances
    return DiffResult(runs, results, find_changes(runs, results, tol, repeat=options.repeat), repeat=options.repeat,
                      noise=find_noise(runs, results, tol, repeat=options.repeat))


def _probe_options(options: DiffOptions, artifacts: Path):
    from kvprobe.probe.run import ProbeOptions

    return ProbeOptions(artifacts_dir=artifacts, tolerances=options.tolerances, budget_seconds=options.budget_seconds,
                        profile=options.profile, log=options.log)


def run_release(exp, options: DiffOptions, artifacts: Path) -> dict:
    """One release: the ledger's start-up first (a release that refuses this configuration is a
    finding, not an error), then the probe, then its figures."""
    from kvprobe.probe.run import apply_overrides, run_probe
    from kvprobe.spec.expectation import ledger_inputs
    from kvprobe.theory.ledger.build import build_ledger

    probe_options = _probe_options(options, artifacts)
    ledger = build_ledger(ledger_inputs(apply_overrides(exp, probe_options)), explain_refusal=True)
    if ledger.refusal is not None:
        options.log(f"kvprobe diff: {exp.engine} {exp.version} would refuse to start: {ledger.refusal}")
        figures = empty_figures(exp, artifacts)
        figures.update(startup="refused", refusal=ledger.refusal, ledger_startup="refused", status="refused",
                       reason="the ledger says this release refuses the configuration; not launched")
        return figures
    result = run_probe(exp, probe_options)
    return release_figures(result, artifacts)


def empty_figures(exp, artifacts: Path) -> dict:
    from kvprobe.theory.admission import policy_for, policy_rule

    policy = policy_for(exp.engine, exp.version, reserve_full_isl=exp.flags.get("scheduler-reserve-full-isl", True)
                        is not False)
    return {"version": exp.version, "startup": None, "refusal": None, "ledger_startup": "starts",
            "policy": policy, "rule": policy_rule(policy), "scheduler_loop": None, "async_scheduling": None,
            "pool_unit": "blocks" if exp.engine == "vllm" else "tokens", "pool": None, "ledger_pool": None,
            "engine_claim": None, "claim_tokens": None, "ledger_claim_tokens": None, "release_rules": {},
            "predicted": None, "predicted_mean": None, "predicted_binding": None, "predicted_usage": None,
            "rejection_point": None, "uncertainty": None, "deep_levels": [],
            "preemptions_per_deep_level": None, "preemptions_per_1k_steps": None, "deep_level_steps": None,
            "ledger_preemption_rate": None, "ledger_preemption_users": None,
            "usage_at_saturation": None, "binding": None, "status": None, "reason": None, "memory": None,
            "artifacts": str(artifacts)}


def release_figures(result, artifacts: Path) -> dict:
    """What the diff compares, from one release's probe result (None where it was not measured)."""
    from kvprobe.report.claim import probe_figures
    from kvprobe.theory.admission import policy_rule

    exp = result.expectation
    out = empty_figures(exp, artifacts)
    adm = (result.ledger or {}).get("admission") or {}
    cap = (result.ledger or {}).get("capacity") or {}
    unit = "num_blocks" if exp.engine == "vllm" else "kv_tokens"
    if adm.get("policy"):
        out.update(policy=adm["policy"], rule=policy_rule(adm["policy"]))
    # the release rules the ledger applied (its JSON: [{"aspect", "rule"}]); SGLang's scheduler loop
    rules = (result.ledger or {}).get("release_rules") or []
    loop = [r.get("rule") for r in rules if r.get("aspect") == "scheduler loop"]
    out["scheduler_loop"] = loop[0] if loop else None
    out["release_rules"] = {r["aspect"]: r["rule"] for r in rules if r.get("aspect") and r.get("rule")}
    # what the ledger says the engine will log (vLLM: "GPU KV cache size", each release's semantics)
    out["ledger_claim_tokens"] = cap.get("kv_tokens")
    out["memory"] = memory_figures((result.ledger or {}).get("budget"))
    out.update(async_scheduling=adm.get("async_scheduling"), ledger_pool=cap.get(unit),
               predicted=adm.get("limit"), predicted_mean=adm.get("limit_mean"), predicted_binding=adm.get("binding"),
               predicted_usage=adm.get("usage_at_limit"), status=result.status, reason=result.status_reason)
    if result.facts is None:
        out["startup"] = "did not start" if result.error else None
        out["refusal"] = result.error
        return out
    out["startup"] = "started"
    out["pool"] = getattr(result.facts.reported, unit, None)
    fig = probe_figures(result)
    if fig is not None and fig.claim is not None:  # the engine's own capacity line, read for this shape
        out["engine_claim"] = {"tokens": fig.claim.tokens, "requests": _round(fig.claim.requests, 2),
                               "source": fig.claim.source}
        out["claim_tokens"] = fig.claim.tokens
    rej = result.rejection
    if rej is not None and rej.rejection_point is not None:
        out.update(rejection_point=_round(rej.rejection_point), uncertainty=_round(rej.uncertainty),
                   usage_at_saturation=_round(rej.usage_at_rejection))
        out["deep_levels"] = list(rej.deep_levels or rej.saturated_levels)
    if result.diagnosis is not None:
        out["binding"] = result.diagnosis.limit
    deep = [lv for lv in result.levels if lv.users in set(out["deep_levels"])]
    out["preemptions_per_deep_level"] = _per_level_preemptions(exp.engine, deep)
    out["preemptions_per_1k_steps"] = _per_1k_steps(out["preemptions_per_deep_level"], deep)
    out["deep_level_steps"] = _steps(deep)
    if deep:
        out["ledger_preemption_users"] = users = max(lv.users for lv in deep)
        out["ledger_preemption_rate"] = _ledger_preemption_rate(exp, users)
    return out


def _per_level_preemptions(engine: str, levels: list) -> float | None:
    """Preemptions (SGLang: retractions) counted per deep level; None when the engine exports no
    counter. SGLang creates its counter at the first retraction: absent there means none yet."""
    from kvprobe.engines import get_dialect

    if not levels:
        return None
    lazy = get_dialect(engine).PREEMPTION_COUNTER_LAZY
    counts = [lv.preemptions if lv.preemptions is not None else (0.0 if lazy else None) for lv in levels]
    if any(c is None for c in counts):
        return None
    return _round(sum(counts) / len(counts))


def _per_1k_steps(per_level: float | None, levels: list) -> float | None:
    """The deep levels' preemptions per 1,000 engine steps, the unit of the ledger's rate (its
    simulation counts steps, not seconds: a count per level grows with the hold, a rate per second
    with the engine's speed). Steps come from the streams (analysis.levels.step_seconds); None when
    a level could not time one, except that no preemption is 0 in any unit."""
    if per_level is None:
        return None
    if per_level == 0:
        return 0.0
    steps = _steps(levels)
    if steps is None:
        return None
    return _round(1000 * sum(lv.preemptions or 0.0 for lv in levels) / steps, 2)


def _steps(levels: list) -> float | None:
    """The engine steps the deep levels lasted (the streams' timing); None when a level could not time one."""
    steps = [getattr(lv, "engine_steps", None) for lv in levels]
    return None if not steps or any(n is None for n in steps) or not sum(steps) else _round(sum(steps), 1)


def _ledger_preemption_rate(exp, users: int) -> float | None:
    """The ledger's preemptions per 1k steps at the deepest level measured (its simulated steady state)."""
    from kvprobe.probe.run import predict

    try:
        return predict(exp, users=users).admission.preemption_rate
    except KvprobeError:
        return None


def _round(x, digits: int = 3):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(float(x), digits)
