"""pytest tells a broken probe from a broken engine: a probe that could not
measure is an *error* of its items, a check that disagrees a *failure*."""

from __future__ import annotations

import pytest
import yaml

from kvprobe.procgroup import free_port
from tests.plugin.conftest import REPO

pytestmark = pytest.mark.slow


def test_an_unreachable_engine_errors_every_item_and_fails_none(kvp):
    doc = yaml.safe_load((REPO / "expectations" / "emulated-vllm.yaml").read_text())
    doc.update(name="nowhere", profile="short")
    (kvp.path / "expectations" / "nowhere.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    url = f"http://127.0.0.1:{free_port()}"
    result = kvp.runpytest_subprocess("--kvprobe", f"--kvprobe-url={url}", "-rE", timeout=120)
    result.assert_outcomes(errors=6)  # one probe, six checks: none failed, none passed
    out = result.stdout.str()
    assert "kvprobe could not measure nowhere[rejection_point]: vllm at " in out and "not healthy" in out
    assert "Traceback" not in out and "verdict: ERROR" in out
    summary = out[out.index("kvprobe summary"):]
    assert "nowhere" in summary and "ERROR" in summary
