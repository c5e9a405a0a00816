"""After the load stops, the probe keeps sampling while the engine drains, for every check that
reads that part of the series — a fleet's replica_leak as well as leak — and only for those."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvprobe.probe import load_steps as probe


class _Sampler:
    def stop(self):
        return "series"


class _Load:
    expect_workers = False

    def stop(self):
        pass

    def client_health(self, t0=None, t1=None):  # load.runner.LocustRun's
        return None

    def records(self):
        return []


@pytest.mark.parametrize("checks, expect_fail, watched", [
    (("replica_leak",), None, True),
    (("leak", "exactness"), None, True),
    (("rejection_point",), "leak", True),
    (("rejection_point", "exactness"), None, False),
])
@pytest.mark.parametrize("idle_report, window", [(None, 7.0), (30.0, 35.0)])
def test_the_drain_is_watched_for_the_checks_that_read_it(monkeypatch, checks, expect_fail, watched, idle_report,
                                                          window):
    seen = []
    monkeypatch.setattr(probe, "wait_drained", lambda sampler, *, seconds: seen.append(seconds))
    exp = SimpleNamespace(checks=checks, expect_fail=expect_fail, profile=SimpleNamespace(drain_seconds=7.0),
                          name="x")
    # an engine that republishes idle gauges every 30 s (SGLang) is watched until that report
    pr = SimpleNamespace(exp=exp, load=_Load(), sampler=_Sampler(), result=SimpleNamespace(client=None), windows=[],
                         log=lambda line: None, dialect=SimpleNamespace(IDLE_REPORT_SECONDS=idle_report))
    probe.stop_load(pr)
    probe.watch_drain(pr)
    assert seen == ([window] if watched else [])
    assert pr.series == "series" and pr.sampler is None
