"""Before an attached probe reads anything, the real SGLang 0.5.23 (a shadow started with --api-key)
is asked for its key and its engine: the 401 it answers without the key is named as that, and
`--engine vllm` against it is stopped by SGLang's own signs (its metric families, /v1/models'
owned_by, /server_info). The emulator's counterparts: tests/cli/test_api_key.py, test_wrong_engine.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvprobe.cli.main import main
from kvprobe.observe.discovery import engine_signs
from tests.cli.console import run

from .conftest import shipped

NAME = "shadow-sglang-kv"
KEY = "sk-shadow-3c8a51"


def _server(shadow_server):
    exp = shipped(NAME)
    return shadow_server(NAME, target=replace(exp.target, engine_args=("--api-key", KEY)))


def test_real_sglang_wants_its_key_and_is_named_when_probed_as_vllm(shadow_server, capsys, monkeypatch):
    server = _server(shadow_server)
    bare = ["probe", "--url", server.url, "--prompt-tokens", "8", "--output-tokens", "8"]
    assert main([*bare, "--engine", "sglang"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvprobe probe: error: --api-key-env: the engine at {server.url} answered HTTP 401 to GET /v1/models: it "
        "was started with an API key (--api-key) and kvprobe sent none; put the key in an environment variable and "
        "name that variable in --api-key-env"]

    signs = engine_signs(server.url, {"Authorization": f"Bearer {KEY}"})
    assert signs == {"vllm": [], "sglang": ["/metrics has sglang: families", "/v1/models says owned_by 'sglang'",
                                            "/server_info answers (SGLang's server info)"]}
    monkeypatch.setenv("KVPROBE_SHADOW_KEY", KEY)
    assert main([*bare, "--engine", "vllm", "--api-key-env", "KVPROBE_SHADOW_KEY"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"kvprobe probe: error: --engine: the server at {server.url} looks like sglang, not "
                                f"vllm ({'; '.join(signs['sglang'])}): probe it with --engine sglang"]
    assert KEY not in err


@pytest.mark.slow
def test_a_staging_probe_without_a_file_passes_on_real_sglang(shadow_server, capsys, monkeypatch, tmp_path):
    # the staging flow as a user meets it: the key in a variable, only the request shape on the command line
    server = _server(shadow_server)
    monkeypatch.setenv("KVPROBE_SHADOW_KEY", KEY)
    art = tmp_path / "art"
    rc, out, err = run(capsys, "probe", "--url", server.url, "--engine", "sglang", "--api-key-env",
                       "KVPROBE_SHADOW_KEY", "--prompt-tokens", "512", "--output-tokens", "256",
                       "--artifacts", str(art))
    assert rc in (0, 3), out[-4000:] + err
    assert "kvprobe: published by the engine: " in out and KEY not in out
    doc = json.loads((art / "result.json").read_text())
    rp = next(c for c in doc["checks"] if c["name"] == "rejection_point")
    assert rp["binding"] == "kv", rp
    # 3 only when a busy runner starved the load generator: every unjudged check says so
    assert rc == 0 or all("load generator was the bottleneck" in c["reason"] for c in doc["checks"]
                          if c["inconclusive"]), out[-4000:]
    assert rp["passed"] or rp["inconclusive"], rp
