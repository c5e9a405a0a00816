"""`kvprobe probe` launches real SGLang 0.5.23 in shadow mode and judges it: KV binds at 21 running
(M=16,384, P=512, O=256), every process stopped afterwards."""

from __future__ import annotations

import json

import pytest

from kvprobe.cli.main import main
from kvprobe.load.runner import LocustRun
from kvprobe.procgroup import group_members
from kvprobe.targets.launch import Target
from kvprobe.theory.sim.steptime import TimeModel

from .conftest import EXPECTATIONS, shipped
from .probes import report

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a probe of a long shape runs 2-5 min here


@pytest.fixture
def started(monkeypatch):
    """Every engine target and Locust run the probe creates (for their group ids afterwards)."""
    seen: list = []
    init, start = Target.__init__, LocustRun.start

    def target_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append(self)

    def run_start(self, *args, **kwargs):
        seen.append(self)
        return start(self, *args, **kwargs)

    monkeypatch.setattr(Target, "__init__", target_init)
    monkeypatch.setattr(LocustRun, "start", run_start)
    return seen


def test_kvprobe_probe_launches_the_sglang_shadow_and_kv_binds(sglang_env, tmp_path, capsys, started, figures):
    art = tmp_path / "art"
    rc = main(["probe", str(EXPECTATIONS), "--name", "shadow-sglang-kv", "--artifacts", str(art)])
    out = capsys.readouterr().out
    print(out)
    doc = json.loads((art / "result.json").read_text())
    report(figures, "kvprobe probe, launched", "shadow-sglang-kv", doc)
    shadow = doc["engine_facts"]["shadow"]
    assert shadow["plugin"] == "active" and shadow["overlap_scheduling"] is True, shadow
    assert shadow["time_model"] == TimeModel(**shipped("shadow-sglang-kv").target.time_model).encode()
    assert doc["engine_facts"]["reported"]["kv_tokens"] == 16384
    assert rc == 0, out
    assert doc["verdict"]["passed"] is True
    pgids = [s.pgid for s in started if s.pgid is not None]
    assert len(pgids) >= 2, "the engine's and Locust's groups were not seen"
    # No live member of any group the probe started. (SGLang's children can outlive its launcher by a
    # moment and be reparented to init, where a zombie may wait to be reaped: procgroup's rule.)
    assert {pgid: group_members(pgid) for pgid in pgids} == {pgid: [] for pgid in pgids}
