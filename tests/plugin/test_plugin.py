"""The pytest face, tested with pytester: collection, skipping, options, ini, reports, teardown."""

from __future__ import annotations

import signal
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from kvprobe.procgroup import signal_group
from tests.plugin.conftest import REPO, pgid_alive

# One level well below the emulated limit of ~20 and three deep past it, as tests/probe/conftest.py's TINY
TINY_PROFILE = """
name: tiny
request: {prompt_tokens: 128, output_tokens: 32, stream: true}
ramp: {strategy: explicit, levels: [12, 28, 32, 36]}
hold: {seconds: 2.0, warmup: 0.3}
sampling: {interval: 0.1}
budget_seconds: 60
drain_seconds: 8
"""


def expectation(name: str, **changes) -> str:
    doc = yaml.safe_load((REPO / "expectations" / "emulated-vllm.yaml").read_text())
    doc.update(name=name, profile="tiny", **changes)
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture
def project(kvp):
    (kvp.path / "loadprofiles" / "tiny.yaml").write_text(TINY_PROFILE)
    (kvp.path / "expectations" / "good.yaml").write_text(expectation("good"))
    return kvp


def test_yaml_items_are_collected_with_readable_ids(project):
    result = project.runpytest("--collect-only", "-q")
    out = result.stdout.str()
    for check in ("rejection_point", "reported_capacity", "leak", "usage_gap", "exactness", "length_limit"):
        assert f"good.yaml::good[{check}]" in out
    assert result.ret == 0


def test_without_flag_probes_are_skipped_with_one_line_reason(project):
    result = project.runpytest("-rs")
    result.assert_outcomes(skipped=6)
    result.stdout.fnmatch_lines(["*needs --kvprobe*"])
    assert "kvprobe summary" not in result.stdout.str()


def test_disabled_plugin_collects_nothing(project):
    result = project.runpytest("-p", "no:kvprobe", "--collect-only", "-q")
    assert "good[" not in result.stdout.str()


def test_yaml_error_is_a_collection_error_naming_file_and_key(project):
    broken = expectation("broken").replace("max-model-len: 2048", "max-model-len: -5")
    (project.path / "expectations" / "broken.yaml").write_text(broken)
    result = project.runpytest("--collect-only")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.INTERRUPTED  # collection errors stop the run
    assert "broken.yaml" in out and "flags.max-model-len" in out
    assert "Traceback" not in out


def test_options_are_documented_under_a_kvprobe_group(project):
    out = project.runpytest("--help").stdout.str()
    assert "kvprobe: KV-cache admission probes" in out
    for option in ("--kvprobe ", "--kvprobe-expectations", "--kvprobe-url", "--kvprobe-engine-command",
                   "--kvprobe-artifacts", "--kvprobe-tolerance", "--kvprobe-budget", "--kvprobe-profile"):
        assert option in out, option
    for ini in ("kvprobe_expectations", "kvprobe_url", "kvprobe_artifacts", "kvprobe_tolerance", "kvprobe_budget"):
        assert ini in out, ini


def test_ini_options_reach_the_header(project):
    project.makeini("[pytest]\naddopts = -p no:cacheprovider\nkvprobe = true\n"
                    "kvprobe_artifacts = out/probes\nkvprobe_expectations = expectations\n")
    result = project.runpytest("--collect-only")
    out = result.stdout.str()
    assert "kvprobe: artifacts out/probes" in out
    assert "kvprobe: good: engine vllm 0.33.0, model meta-llama/Llama-3.1-8B" in out


@pytest.mark.parametrize("option", [["--kvprobe-budget", "abc"], ["--kvprobe-budget", "-5"],
                                    ["--kvprobe-tolerance", "rejection=1"], ["--kvprobe-tolerance", "usage_gap=7"]])
def test_bad_options_are_one_line_usage_errors(project, option):
    result = project.runpytest("--kvprobe", "--collect-only", *option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "kvprobe:" in err and "Traceback" not in err


def test_coexists_with_locusts_own_pytest_plugin(project):
    """Locust's wheel auto-loads a plugin that claims --host/-H and a `session` fixture."""
    out = project.runpytest("--help").stdout.str()
    assert "--host" in out and "--kvprobe-url" in out


def test_marker_kvprobe_skips_hand_written_tests_without_flag(project):
    project.makepyfile(test_kvp_hand="""
        import pytest

        @pytest.mark.kvprobe
        def test_needs_engine():
            raise AssertionError("must not run without --kvprobe")

        def test_plain():
            pass
    """)
    result = project.runpytest("-rs", "test_kvp_hand.py")
    result.assert_outcomes(passed=1, skipped=1)


def test_ledger_fixture_needs_no_server(project):
    project.makepyfile(test_kvp_ledger_fixture="""
        def test_ledger(kvprobe_ledger):
            ledger = kvprobe_ledger("expectations/good.yaml")
            assert ledger.to_dict()["capacity"]["num_blocks"] == 201
            assert ledger.admission.no_preemption_limit == 20
    """)
    project.runpytest("test_kvp_ledger_fixture.py").assert_outcomes(passed=1)


@pytest.mark.slow
def test_passing_and_failing_probes_summary_and_junit(project):
    """One real probe that passes and one that fails, each against its own emulator."""
    bad = yaml.safe_load(expectation("leaky"))
    bad["target"]["emulator"]["faults"] = ["zombie-blocks"]
    bad["checks"] = ["leak"]
    (project.path / "expectations" / "leaky.yaml").write_text(yaml.safe_dump(bad))
    result = project.runpytest_subprocess("--kvprobe", "--junitxml=junit.xml", timeout=300)
    out = result.stdout.str()
    result.assert_outcomes(passed=6, failed=1)
    assert "leaky[leak]" in out and "FAIL" in out
    assert "Traceback" not in out  # a failing check reports the table, not a stack
    assert "after the load stopped" in " ".join(out.split())  # the leak check's reason (wrapped in its column)
    assert "kvprobe summary" in out
    summary = out[out.index("kvprobe summary"):]
    assert "good" in summary and "leaky" in summary and "PASS" in summary
    junit = ET.parse(project.path / "junit.xml")
    props = {p.get("name"): p.get("value") for p in junit.iter("property")}
    assert props["kvprobe_check"] and "kvprobe_predicted" in props and "kvprobe_measured" in props


def _wait_for(path: Path, deadline: float) -> str:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.1)
    raise AssertionError(f"{path} never appeared")


TARGET_TEST = """
    import time
    from pathlib import Path

    def test_uses_engine(kvprobe_target):
        target = kvprobe_target("expectations/good.yaml")
        Path("pgid").write_text(str(target.pgid))
        {body}
"""


@pytest.mark.slow
def test_shared_target_torn_down_when_a_test_fails(project):
    project.makepyfile(test_kvp_target=TARGET_TEST.format(body="assert False, 'boom'"))
    result = project.runpytest_subprocess("--kvprobe", "test_kvp_target.py", timeout=120)
    result.assert_outcomes(failed=1)
    pgid = int((project.path / "pgid").read_text())
    assert not pgid_alive(pgid)


@pytest.mark.slow
def test_shared_target_torn_down_on_ctrl_c(project):
    project.makepyfile(test_kvp_target=TARGET_TEST.format(body="time.sleep(120)"))
    proc = project.popen([sys.executable, "-m", "pytest", "--kvprobe", "test_kvp_target.py"],
                         stdin=None)
    pgid = None
    try:
        pgid = int(_wait_for(project.path / "pgid", 60))
        assert pgid_alive(pgid)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            if pgid is not None:  # the session did not stop its target: this test does, or it outlives the suite
                signal_group(pgid, signal.SIGKILL)
    end = time.monotonic() + 15
    while pgid_alive(pgid) and time.monotonic() < end:
        time.sleep(0.1)
    assert not pgid_alive(pgid)
