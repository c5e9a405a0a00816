"""`versions: [A, B]` in an expectation: `pytest --kvprobe` makes one probe (and its check items) per
release, and `expect_change:` one item that fails when a named figure does not change between them."""

from __future__ import annotations

import pytest
import yaml

from kvprobe.errors import ConfigError
from kvprobe.pytest_plugin.session import release_expectations
from kvprobe.spec.expectation import load_expectations
from tests.plugin.conftest import REPO


def pair(**changes) -> str:
    doc = yaml.safe_load((REPO / "expectations" / "diff" / "vllm-first-chunk.yaml").read_text())
    doc.update(name="pair", versions=["0.11.0", "0.33.0"], checks=["rejection_point"], **changes)
    return yaml.safe_dump(doc, sort_keys=False)


def test_one_item_set_per_release_and_one_for_the_expected_change(kvp):
    (kvp.path / "expectations" / "pair.yaml").write_text(pair(expect_change=["preemptions"]))
    # in a subprocess: an in-process run drops the modules it imported (numpy's among them), which the tests
    # after it in this process cannot import again
    out = kvp.runpytest_subprocess("--collect-only", "-q").stdout.str()
    for item in ("pair@0.11.0[rejection_point]", "pair@0.33.0[rejection_point]", "pair[expect_change]"):
        assert f"pair.yaml::{item}" in out


def test_repeat_makes_a_probe_per_run_of_each_release(tmp_path):
    # the expectations the plugin collects items for (loaded directly, as below)
    path = tmp_path / "pair.yaml"
    path.write_text(pair(expect_change=["preemptions"], repeat=2))
    (exp,) = load_expectations(path)
    runs = release_expectations(exp)
    assert [r.name for r in runs] == ["pair@0.11.0", "pair@0.11.0#2", "pair@0.33.0", "pair@0.33.0#2"]
    assert [r.version for r in runs] == ["0.11.0", "0.11.0", "0.33.0", "0.33.0"]
    assert {r.repeat for r in runs} == {1} and not any(r.versions for r in runs)  # each run is one probe


@pytest.mark.parametrize("changes, said", [
    ({"expect_change": ["preemptions"], "versions": None},
     "expect_change: expected `versions: [A, B]` beside it (a change is between releases), got no versions"),
    ({"versions": ["0.11.0", "0.99.0"]}, "versions[1]: expected a vllm version kvprobe has facts for"),
    ({"versions": ["0.33.0"]}, "versions: expected two or more versions, got 1"),
    ({"expect_change": ["plateau"]}, "expect_change[0]: expected a figure that changes, one of"),
    ({"policy": "vllm-0.33"}, "versions: expected no `policy:` beside it"),
    ({"repeat": 0}, "repeat: expected a whole number of runs per release >= 1, got 0"),
    ({"repeat": "twice"}, "repeat: expected a whole number of runs per release"),
    ({"repeat": 2, "versions": None},
     "repeat: expected `versions: [A, B]` beside it (a change is between releases), got no versions"),
])
def test_a_bad_versions_key_is_refused_naming_it(tmp_path, changes, said):
    # loaded directly: pytester's in-process runs cannot import the theory's compiled modules twice
    doc = yaml.safe_load(pair())
    doc.update(changes)
    path = tmp_path / "pair.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in doc.items() if v is not None}, sort_keys=False))
    with pytest.raises(ConfigError) as err:
        load_expectations(path)
    assert f"{path}: {said}" in str(err.value)


@pytest.mark.slow
def test_the_expected_change_is_found_and_a_missing_one_fails(kvp):
    # preemptions change from 0.11 to 0.33 (first-chunk against whole-prompt admission); the pool does not
    (kvp.path / "expectations" / "pair.yaml").write_text(pair(expect_change=["preemptions", "pool"]))
    result = kvp.runpytest("--kvprobe", "--kvprobe-artifacts", str(kvp.path / "art"), "-rf")
    outcomes = result.parseoutcomes()
    # the expect_change item fails (pool); each release's item passes, or errs when the shared machine
    # starved the load generator (that probe still measured the preemptions the change reads)
    assert outcomes.get("failed") == 1 and outcomes.get("passed", 0) + outcomes.get("errors", 0) == 2, outcomes
    out = result.stdout.str()
    assert "expected a change of pool between 0.11.0 -> 0.33.0" in out
    assert "preemptions per 1k steps" in out and "explained: vllm-0.11 -> vllm-0.33" in out
    assert (kvp.path / "art" / "pair@0.11.0" / "result.json").is_file()
