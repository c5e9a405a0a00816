"""The API key of an attached target: read from an environment variable, sent (the probe really
authenticates — a wrong key gets 401), and never seen again: not in a log line, an artifact, the
console's output, a pytest report or JUnit XML, nor an exception's text."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from kvprobe.engines import get_dialect
from kvprobe.errors import ConfigError
from kvprobe.observe.oneshot import post_completion, unique_prompt
from kvprobe.probe.run import ProbeOptions, run_probe
from kvprobe.procgroup import free_port
from kvprobe.targets.launch import Target
from tests.probe.conftest import TINY

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ENV = "KVPROBE_HARDENING_API_KEY"
FAST = TINY.replace("levels: [10, 28, 32, 36]", "levels: [10, 20, 28]").replace("drain_seconds: 6",
                                                                                          "drain_seconds: 3")
assert FAST != TINY  # the fast profile really is faster

COMPLETIONS = get_dialect("vllm").COMPLETIONS_PATH


@pytest.fixture(scope="module")
def key() -> str:
    return "sk-kvp-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def secured(tmp_path_factory, key):
    """The vLLM emulator of emulated-vllm.yaml, requiring `Authorization: Bearer <key>`.

    The key reaches it through VLLM_API_KEY (as `vllm serve` reads it), not argv, so no `ps` shows it."""
    exp_doc = yaml.safe_load((REPO / "expectations" / "emulated-vllm.yaml").read_text())
    dialect = get_dialect("vllm")
    port = free_port()
    argv = dialect.emulator_command(exp_doc["model"], exp_doc["flags"], host="127.0.0.1", port=port)
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with Target.launch(argv, engine="vllm", port=port, log_path=str(log), startup_timeout=30,
                       env={"VLLM_API_KEY": key}) as target:
        yield target, log


def project(root: Path, url: str) -> Path:
    (root / "loadprofiles").mkdir(parents=True, exist_ok=True)
    (root / "loadprofiles" / "tiny.yaml").write_text(FAST)
    (root / "expectations").mkdir(exist_ok=True)
    doc = yaml.safe_load((REPO / "expectations" / "emulated-vllm.yaml").read_text())
    doc.update(name="secured", profile="tiny", target={"url": url, "api_key_env": ENV})
    path = root / "expectations" / "secured.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def files_holding(root: Path, key: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]


def authenticated_requests(art: Path) -> int:
    import json

    records = [json.loads(x) for x in (art / "requests.jsonl").read_text().splitlines()]
    assert records and not [r for r in records if r["status"] == 401]
    return sum(r["status"] == 200 for r in records)


def test_the_emulator_really_requires_the_key(secured, key):
    target, _ = secured
    body = get_dialect("vllm").completion_body(unique_prompt(16, 7), 4, model=None, stream=False)
    # a 401 is bad input said as the API key (kvprobe.observe.client), the key itself never shown
    with pytest.raises(ConfigError, match="answered HTTP 401 to POST /v1/completions: it was started with an API"):
        post_completion(target.url, body, path=COMPLETIONS, headers={}, timeout=10)
    with pytest.raises(ConfigError, match="it refused the API key kvprobe sent") as wrong:
        post_completion(target.url, body, path=COMPLETIONS, headers={"Authorization": "Bearer sk-wrong"}, timeout=10)
    assert "sk-wrong" not in str(wrong.value)
    right = post_completion(target.url, body, path=COMPLETIONS, headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert right.status == 200 and key not in right.body


def test_console_probe_with_the_key_leaks_it_nowhere(secured, key, tmp_path):
    target, engine_log = secured
    exp_path = project(tmp_path, target.url)
    art = tmp_path / "art"
    proc = subprocess.run([sys.executable, "-m", "kvprobe", "probe", str(exp_path), "--artifacts", str(art)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, ENV: key, "PYTHONPATH": str(REPO)})
    # a verdict (3: three levels may not confirm the plateau — the test is about the key), not bad input
    assert proc.returncode in (0, 1, 3) and "verdict: " in proc.stdout, proc.stderr
    assert authenticated_requests(art) > 100
    assert key not in proc.stdout and key not in proc.stderr
    assert files_holding(art, key) == []  # result.json, requests.jsonl, locust/locust.log, report.txt...
    assert (art / "locust" / "locust.log").exists()
    assert key not in engine_log.read_text()


def test_pytest_probe_with_the_key_leaks_it_nowhere(secured, key, pytester, monkeypatch):
    target, engine_log = secured
    project(pytester.path, target.url)
    pytester.makeini("[pytest]\naddopts = -p no:cacheprovider\n")
    monkeypatch.setenv(ENV, key)
    art = pytester.path / "art"
    result = pytester.runpytest_subprocess("--kvprobe", "--kvprobe-url", target.url, "--kvprobe-artifacts",
                                           str(art), "--junitxml", "junit.xml", "-rA", "-v", "expectations",
                                           timeout=120)
    out = result.stdout.str() + result.stderr.str()
    assert "secured[rejection_point]" in out and "kvprobe summary" in out
    assert authenticated_requests(art / "secured") > 100
    assert key not in out
    assert files_holding(pytester.path, key) == []  # JUnit XML and every artifact
    assert (pytester.path / "junit.xml").stat().st_size > 0
    assert key not in engine_log.read_text()


def test_a_wrong_key_fails_with_401_and_neither_key_is_shown(secured, key, expectation, tmp_path, monkeypatch):
    target, _ = secured
    wrong = "sk-kvp-" + secrets.token_hex(16)
    monkeypatch.setenv(ENV, wrong)
    exp = expectation("emulated-vllm.yaml")
    exp = replace(exp, target=replace(exp.target, mode="url", url=target.url, api_key_env=ENV))
    with pytest.raises(ConfigError) as err:  # bad input: said as the key (exit 2), its artifacts still written
        run_probe(exp, ProbeOptions(artifacts_dir=tmp_path / "art"))
    assert "answered HTTP 401 to GET /v1/models: it refused the API key" in str(err.value)
    result = json.loads((tmp_path / "art" / "result.json").read_text())
    assert "401" in result["verdict"]["error"]
    for text in (str(err.value), json.dumps(result), (tmp_path / "art" / "report.txt").read_text()):
        assert wrong not in text and key not in text
    assert files_holding(tmp_path / "art", wrong) == []
