"""Which levels' preemptions the policy cannot explain: the ledger simulates each level's steady
state (schedsim) and only levels it never preempts at count against the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from kvprobe.probe import judge as probe_judge
from kvprobe.probe import run as probe
from kvprobe.spec.expectation import load_expectations

SHIPPED = Path(__file__).resolve().parents[2] / "expectations" / "shadow-vllm-overadmission.yaml"


@dataclass
class Level:
    users: int
    preemptions: float | None
    too_few_samples: bool = False


def run_of(name: str, levels: list[Level]):
    exp = next(e for e in load_expectations(SHIPPED) if e.name == name)
    return SimpleNamespace(exp=exp, ledger=probe.predict(exp), result=SimpleNamespace(levels=levels))


MEASURED = [Level(6, 0.0), Level(10, 0.0), Level(14, 37.0), Level(20, 52.0), Level(24, 2.0), Level(30, None)]


def test_full_isl_admission_explains_no_preemption_where_requests_wait():
    # vLLM 0.33's default: P=3000 is admitted only when it fits to the end, so no level preempts
    assert probe_judge._unpredicted_preemptions(run_of("shadow-vllm-overadmission-undeclared", MEASURED)) == [
        (14, 37.0), (20, 52.0)]  # 24: two preemptions are below the threshold; 30: no counter


def test_first_chunk_admission_explains_them():
    # the flag declared: the ledger follows it (policy vllm-0.11) and predicts these preemptions
    assert probe_judge._unpredicted_preemptions(run_of("shadow-vllm-overadmission", MEASURED)) == []
