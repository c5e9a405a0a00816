"""Fixtures of the hardening tests: the fast `tiny` profile of tests/probe, and the process groups a
probe starts, captured so a test can prove by group id that none of them is left."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import pytest

from kvprobe.engines.launcher import Target
from kvprobe.load.runner import LocustRun
from tests.probe.conftest import expectation, tiny_profile  # noqa: F401 — re-exported fixtures


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
