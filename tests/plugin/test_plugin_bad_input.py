"""`pytest --kvprobe` against an engine that refuses the API key, or that is the other engine: bad
input, said as that on every item of the expectation and as a usage error of the run (the console's
exit 2), never a probe that "could not measure". Against kvprobe's emulators over real HTTP."""

from __future__ import annotations

import pytest
import yaml

from tests.cli.console import FLAGS
from tests.emulator.conftest import FAST, Served
from tests.plugin.conftest import REPO


def _served(engine: str, **extra) -> Served:
    from kvprobe.targets.emulator.app import Settings

    return Served(Settings(engine=engine, model="meta-llama/Llama-3.1-8B", flags={**FLAGS[engine], **extra},
                           time_model=FAST))


@pytest.fixture
def served():
    started = []

    def start(engine: str, **extra) -> Served:
        started.append(_served(engine, **extra))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def _expectation(kvp, engine: str) -> None:
    doc = yaml.safe_load((REPO / "expectations" / f"emulated-{engine}.yaml").read_text())
    doc.update(name="staging", profile="short")
    (kvp.path / "expectations" / "staging.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def _said(result) -> tuple[str, list[str]]:
    out = result.stdout.str()
    return out, [line for line in out.splitlines() if "kvprobe: bad input: " in line]


def test_a_missing_api_key_is_bad_input(kvp, served):
    engine = served("vllm", **{"api-key": "sk-plugin-1f"})
    _expectation(kvp, "vllm")
    result = kvp.runpytest_subprocess("--kvprobe", f"--kvprobe-url={engine.url}", "-rE", timeout=120)
    result.assert_outcomes(errors=6)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    out, said = _said(result)
    assert "could not measure" not in out and "Traceback" not in out
    assert any(line.startswith("kvprobe: bad input: staging: ") and "target.api_key_env: the engine at "
               f"{engine.url} answered HTTP 401 to GET /v1/models: it was started with an API key" in line
               for line in said)
    assert "sk-plugin-1f" not in out


def test_the_other_engine_is_bad_input(kvp, served):
    engine = served("sglang")
    _expectation(kvp, "vllm")
    result = kvp.runpytest_subprocess("--kvprobe", f"--kvprobe-url={engine.url}", "-rE", timeout=120)
    result.assert_outcomes(errors=6)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    out, said = _said(result)
    assert "could not measure" not in out
    assert any(f"engine: the server at {engine.url} looks like sglang, not vllm" in line and
               line.rstrip().endswith("write `engine: sglang`") for line in said), said


def test_a_collection_error_that_is_not_kvprobes_is_reported_not_a_crash(kvp):
    """An expectation file whose loading fails with an error kvprobe did not raise: pytest's own
    collection-error report, never an INTERNALERROR from the plugin's failure text."""
    kvp.makeconftest("""
import kvprobe.spec.expectation as spec

def _broken(*args, **kwargs):
    raise RuntimeError("boom from a broken loader")

spec.load_expectations = _broken
""")
    _expectation(kvp, "vllm")
    result = kvp.runpytest_subprocess("--kvprobe", timeout=120)
    out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in out and "TypeError" not in out
    assert "boom from a broken loader" in out
    result.assert_outcomes(errors=1)
