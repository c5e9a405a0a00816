import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from kvprobe.load.runner import LocustRun
from kvprobe.spec.expectation import load_expectations
from kvprobe.spec.profile import load_profile
from kvprobe.targets.launch import Target

REPO = Path(__file__).resolve().parents[2]

# Levels chosen around the emulated pools' limit of ~20 as the predict ramp places them: one well below
# it (the hinge fit's duty cycle, step queueing) and three deep enough (N >= 20 / 0.9 + 2.2: a queue
# that rarely empties) to measure the plateau to within the expectations' ±1 request. Levels near the
# knee weigh nothing in the plateau (docs/probe.md) and cost a hold each.
TINY = """
name: tiny
request: {prompt_tokens: 128, output_tokens: 32, stream: true}
ramp: {strategy: explicit, levels: [10, 28, 32, 36]}
hold: {seconds: 2.0, warmup: 0.3}
sampling: {interval: 0.1}
budget_seconds: 60
drain_seconds: 6
"""


@pytest.fixture(scope="session")
def tiny_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profiles") / "tiny.yaml"
    path.write_text(TINY)
    return load_profile(path)


@pytest.fixture
def expectation(tiny_profile):
    """`expectation("emulated-vllm.yaml")` → the shipped expectation with the tiny profile."""

    def get(relpath: str, **changes):
        exp = load_expectations(REPO / "expectations" / relpath)[0]
        return replace(exp, profile=tiny_profile, **changes)

    return get


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_group_gone(pgid: int, seconds: float = 5.0) -> bool:
    """Polls (bounded) — the probe reaps its groups before returning, so this is normally instant."""
    end = time.monotonic() + seconds
    while group_alive(pgid) and time.monotonic() < end:
        time.sleep(0.05)
    return not group_alive(pgid)


@dataclass
class Groups:
    targets: list = field(default_factory=list)
    runs: list = field(default_factory=list)

    @property
    def engine_pgids(self) -> list[int]:
        return [t.pgid for t in self.targets if t.pgid is not None]

    @property
    def locust_pgids(self) -> list[int]:
        return [r.pgid for r in self.runs if r.pgid is not None]

    def assert_none_left(self) -> None:
        assert self.engine_pgids or self.locust_pgids, "no process group was captured: nothing to check"
        for pgid in self.engine_pgids + self.locust_pgids:
            with pytest.raises(ProcessLookupError):
                os.killpg(pgid, 0)


@pytest.fixture
def groups(monkeypatch) -> Groups:
    """Every Target and LocustRun a probe creates in this test, in order (their pgids afterwards)."""
    seen = Groups()
    init, start = Target.__init__, LocustRun.start

    def target_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.targets.append(self)

    def run_start(self, *args, **kwargs):
        seen.runs.append(self)
        return start(self, *args, **kwargs)

    monkeypatch.setattr(Target, "__init__", target_init)
    monkeypatch.setattr(LocustRun, "start", run_start)
    return seen
