"""What `pytest --kvprobe` collects: from the project's root with no paths, the expectations only
(not the unit tests under `testpaths`); pointed at expectation files or folders, those only; and the
lines naming expectations name the ones collected, not every file of the project."""

from __future__ import annotations

import yaml

from tests.plugin.conftest import REPO


def _expectation(kvp, name: str, engine: str = "vllm") -> None:
    doc = yaml.safe_load((REPO / "expectations" / f"emulated-{engine}.yaml").read_text())
    doc.update(name=name, profile="short")
    (kvp.path / "expectations" / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def _project(kvp):
    kvp.makepyprojecttoml('[tool.pytest.ini_options]\ntestpaths = ["tests"]\naddopts = "-p no:cacheprovider"\n')
    (kvp.path / "pytest.ini").unlink(missing_ok=True)
    (kvp.path / "tox.ini").unlink(missing_ok=True)
    (kvp.path / "tests").mkdir()
    (kvp.path / "tests" / "test_unit.py").write_text("def test_unit():\n    pass\n")
    _expectation(kvp, "alpha")
    _expectation(kvp, "beta", "sglang")
    return kvp


def _named(out: str) -> list[str]:
    return [line.split(":")[1].strip() for line in out.splitlines()
            if line.startswith("kvprobe: ") and ": engine " in line]


def test_kvprobe_from_the_root_collects_the_expectations_only(kvp):
    result = _project(kvp).runpytest("--kvprobe", "--collect-only", "-q")
    out = result.stdout.str()
    assert "test_unit" not in out
    assert "alpha.yaml::alpha[rejection_point]" in out and "beta.yaml::beta[rejection_point]" in out
    assert sorted(_named(out)) == ["alpha", "beta"]


def test_one_file_pointed_at_is_the_only_one_collected_and_named(kvp):
    result = _project(kvp).runpytest("--kvprobe", "--collect-only", "expectations/beta.yaml")
    out = result.stdout.str()
    assert "alpha" not in out and "test_unit" not in out
    assert _named(out) == ["beta"]
    assert "kvprobe: beta: engine sglang 0.5.23, model meta-llama/Llama-3.1-8B" in out


def test_deselected_expectations_are_not_named(kvp):
    result = _project(kvp).runpytest("--kvprobe", "--collect-only", "-k", "alpha")
    assert _named(result.stdout.str()) == ["alpha"]


def test_without_kvprobe_the_unit_tests_and_the_skipped_probes(kvp):
    result = _project(kvp).runpytest("--collect-only", "-q")
    out = result.stdout.str()
    assert "tests/test_unit.py::test_unit" in out and "alpha.yaml::alpha[leak]" in out


def test_a_unit_test_path_with_kvprobe_is_collected_as_given(kvp):
    result = _project(kvp).runpytest("--kvprobe", "--collect-only", "-q", "tests")
    out = result.stdout.str()
    assert "tests/test_unit.py::test_unit" in out and "alpha" not in out and _named(out) == []
