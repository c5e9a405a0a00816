"""An engine that wants an API key: kvprobe says so first (exit 2, naming the key and where to name
its variable), for an engine started with `--api-key` and no key sent, and for a key it refuses.
Against kvprobe's emulator of either engine, which checks keys as the engines do
(tests/emulator/test_api_key.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.cli.console import FLAGS, bare, run
from tests.emulator.conftest import FAST, Served

KEY = "sk-cli-7d2e0b19"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["vllm", "sglang"])
def guarded(request):
    from kvprobe.targets.emulator.app import Settings

    served = Served(Settings(engine=request.param, model="test/model", flags={**FLAGS[request.param], "api-key": KEY},
                             time_model=FAST))
    yield request.param, served
    served.stop()


def test_no_key_sent_is_named_first(capsys, guarded):
    engine, served = guarded
    rc, out, err = run(capsys, *bare(engine, served.url))
    assert rc == 2 and out == ""
    assert err.splitlines() == [
        f"kvprobe probe: error: --api-key-env: the engine at {served.url} answered HTTP 401 to GET /v1/models: it was "
        "started with an API key (--api-key) and kvprobe sent none; put the key in an environment variable and name "
        "that variable in --api-key-env"]


def test_a_refused_key_is_named(capsys, guarded, monkeypatch):
    engine, served = guarded
    monkeypatch.setenv("KVPROBE_CLI_KEY", "sk-not-the-key")
    rc, _, err = run(capsys, *bare(engine, served.url), "--api-key-env", "KVPROBE_CLI_KEY")
    assert rc == 2
    (line,) = err.splitlines()
    assert line.startswith("kvprobe probe: error: --api-key-env: ")
    assert "answered HTTP 401 to GET /v1/models: it refused the API key in $KVPROBE_CLI_KEY" in line
    assert "sk-not-the-key" not in err


def test_the_right_key_goes_on_to_discovery(capsys, guarded, monkeypatch):
    engine, served = guarded
    monkeypatch.setenv("KVPROBE_CLI_KEY", KEY)
    # the served id has no preset: discovery read it through the key, and the next question is the geometry
    rc, _, err = run(capsys, *bare(engine, served.url), "--api-key-env", "KVPROBE_CLI_KEY")
    assert rc == 2
    (line,) = err.splitlines()
    assert line.startswith("kvprobe probe: error: --model-config: expected a served model kvprobe has a preset for")
    assert "'test/model'" in line and KEY not in err


def test_an_expectation_attached_without_its_key(capsys, guarded, tmp_path):
    engine, served = guarded
    base = yaml.safe_load((REPO / "expectations" / f"emulated-{engine}.yaml").read_text())
    base["target"] = {"url": served.url}
    path = tmp_path / "attached.yaml"
    path.write_text(yaml.safe_dump(base))
    rc, out, err = run(capsys, "probe", str(path))
    assert rc == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"kvprobe probe: error: {path}: target.api_key_env: the engine at {served.url} answered "
                           "HTTP 401 to GET /v1/models: it was started with an API key")
