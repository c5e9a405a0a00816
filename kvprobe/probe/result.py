"""What a probe returns and writes: `ProbeResult` (status, reason, the `kvprobe.result/2` JSON) and
the `ProbeOptions` a caller gives `run_probe`."""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvprobe import __version__
from kvprobe.report.claim import probe_figures
from kvprobe.verdict import checks as verdict

SCHEMA_VERSION = 2  # 2: verdict.status, diagnosis, plateau uncertainty, absent metrics as null


@dataclass
class ProbeOptions:
    artifacts_dir: Path
    url: str | None = None  # attach here instead of launching
    engine_command: list[str] | None = None  # replaces the dialect's launch command
    tolerances: dict[str, float] = field(default_factory=dict)  # overrides by name
    budget_seconds: float | None = None
    profile: str | None = None  # a profile name or path replacing the expectation's
    log: Callable[[str], None] = lambda line: None


# The three outcomes of a probe (console exit codes 0, 1 and 3; pytest passed, failed and error).
PASSED, FAILED, ERROR = "passed", "failed", "error"


@dataclass
class ProbeResult:
    expectation: object
    ledger: dict | None = None
    facts: object = None
    levels: list = field(default_factory=list)
    rejection: object = None
    diagnosis: object = None  # kvprobe.analysis.diagnosis.Diagnosis: the limit the measurement shows
    drain: object = None
    client: object = None
    checks: list[verdict.CheckResult] = field(default_factory=list)
    discovery: dict | None = None  # what the engine publishes vs the expectation (discover.Discovery)
    artifacts: dict[str, str] = field(default_factory=dict)
    error: str | None = None  # why the probe could not complete, if it could not
    log_tail: str | None = None  # the engine's (or Locust's) last log lines behind `error`
    fleet: dict | None = None  # a fleet target: per-replica figures per level (kvprobe/verdict/fleet.py)
    ramp: dict | None = None  # the ramp's cost: seconds and request lifetimes per level (kvprobe.probe.ramp)
    repro: str | None = None  # an attached probe: the repro.yaml it wrote (kvprobe.probe.repro)
    staging: dict | None = None  # a repro.yaml's replay: its plateau beside staging's (repro.compare)
    started: float = field(default_factory=time.time)
    finished: float | None = None

    @property
    def expected_failure(self) -> str | None:
        return self.expectation.expect_fail

    def check(self, name: str) -> verdict.CheckResult | None:
        return next((c for c in self.checks if c.name == name), None)

    @property
    def status(self) -> str:
        """passed: every selected check passes (a fault expectation: its check fails, for a reason).
        failed: a check disagrees. error: the probe could not measure — the engine was unreachable
        or died, the client saturated, no metrics, too few deep levels — so nothing was judged.
        A definite disagreement wins over a check that could not be judged."""
        if self.error:
            return ERROR
        if self.expected_failure:
            target = self.check(self.expected_failure)
            if target is None or target.inconclusive:
                return ERROR
            return FAILED if target.passed else PASSED
        if not self.checks:
            return ERROR
        if any(not c.passed and not c.inconclusive for c in self.checks):
            return FAILED
        return ERROR if any(c.inconclusive for c in self.checks) else PASSED

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def status_reason(self) -> str:
        """One line: why the status is what it is."""
        if self.error:
            return self.error
        if self.expected_failure:
            target = self.check(self.expected_failure)
            if target is None or target.inconclusive:
                return f"could not measure {self.expected_failure}" + (f": {target.reason}" if target else "")
            return (f"{self.expected_failure} failed as the fault expects" if not target.passed
                    else f"{self.expected_failure} passed, but the fault expectation needs it to fail")
        failed = [c.name for c in self.checks if not c.passed and not c.inconclusive]
        if failed:
            return "failed: " + ", ".join(failed)
        unjudged = [c for c in self.checks if c.inconclusive]
        if unjudged:
            return "could not measure " + "; ".join(f"{c.name}: {c.reason}" for c in unjudged)
        return "every check passed" if self.checks else "no check was run"

    def to_dict(self) -> dict:
        exp = self.expectation
        facts = self.facts
        return {
            "schema": f"kvprobe.result/{SCHEMA_VERSION}",
            "kvprobe_version": __version__,
            "expectation": {"name": exp.name, "path": str(exp.path), "engine": exp.engine, "version": exp.version,
                            "model": exp.model, "flags": exp.flags, "expect_fail": exp.expect_fail},
            "environment": {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count(), "started": self.started, "finished": self.finished},
            "prediction": self.ledger,
            "engine_facts": _facts_dict(facts),
            "discovery": self.discovery,
            "levels": [_plain(x) for x in self.levels],
            "rejection": _plain(self.rejection),
            "diagnosis": _plain(self.diagnosis),
            "drain": _plain(self.drain),
            "client": _plain(self.client),
            "checks": [c.to_dict() for c in self.checks],
            "fleet": _plain(self.fleet),
            "figures": None if (figures := probe_figures(self)) is None else figures.to_dict(),
            "ramp": _plain(self.ramp),
            "repro": self.repro,
            "staging": _plain(self.staging),
            "verdict": {"status": self.status, "passed": self.passed, "reason": self.status_reason,
                        "error": self.error, "log_tail": self.log_tail},
            "artifacts": self.artifacts,
        }


def _plain(obj):
    """JSON-ready: dataclasses as dicts, and a measurement that is absent (NaN) as null, never 0."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (int, str, bool)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _plain(getattr(obj, k)) for k in obj.__dataclass_fields__}
    return str(obj)


def _facts_dict(facts) -> dict | None:
    if facts is None:
        return None
    out = _plain(facts)
    out.pop("headers", None)  # never written: may carry the attached target's API key
    return out
