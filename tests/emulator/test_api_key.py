"""API keys as the real engines check them (vLLM --api-key / VLLM_API_KEY, SGLang --api-key): which paths
are guarded, the 401 body, and that the key never shows in the emulator's output, repr or /server_info."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvprobe.engines import sglang, vllm
from kvprobe.targets.emulator.app import Emulator, Settings

KEY = "sk-test-4f1c9e7a"  # recognisable, so a leak is easy to grep
REPO = Path(__file__).parents[2]
VLLM_FLAGS = {"num-gpu-blocks-override": 200, "max-model-len": 1024}
SGLANG_FLAGS = {"max-total-tokens": 4000, "context-length": 1024, "enable-metrics": True}
BODY = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}


def call(port: int, method: str, path: str, body: dict | None = None, auth: str | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        headers = {"Content-Type": "application/json"}
        if auth is not None:
            headers["Authorization"] = auth
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def assert_unauthorized(port, method, path, body=None, auth=None):
    status, text = call(port, method, path, body, auth)
    assert (status, json.loads(text)) == (401, {"error": "Unauthorized"}), (path, auth, status, text)


def test_vllm_guards_v1_only(serve):
    s = serve("vllm", {**VLLM_FLAGS, "api-key": KEY})
    for auth in (None, "Bearer wrong", f"Basic {KEY}", KEY, "Bearer", f"Bearer  {KEY}"):
        assert_unauthorized(s.port, "POST", "/v1/completions", BODY, auth)
    assert_unauthorized(s.port, "GET", "/v1/models")
    assert_unauthorized(s.port, "GET", "/v1/no-such-route")  # the middleware runs before routing
    for auth in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}"):
        status, text = call(s.port, "POST", "/v1/completions", BODY, auth)
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3, text
    for path in ("/health", "/metrics", "/version", "/load"):  # outside GUARDED_PREFIX
        assert call(s.port, "GET", path)[0] == 200, path


def test_vllm_key_from_environment_and_flag_wins(serve, monkeypatch):
    monkeypatch.setenv(vllm.API_KEY_ENV, KEY)
    s = serve("vllm", VLLM_FLAGS)
    assert_unauthorized(s.port, "GET", "/v1/models")
    assert call(s.port, "GET", "/v1/models", auth=f"Bearer {KEY}")[0] == 200
    s2 = serve("vllm", {**VLLM_FLAGS, "api-key": "sk-other"})  # --api-key takes precedence over the env var
    assert_unauthorized(s2.port, "GET", "/v1/models", auth=f"Bearer {KEY}")
    assert call(s2.port, "GET", "/v1/models", auth="Bearer sk-other")[0] == 200


def test_no_key_no_check(serve, monkeypatch):
    monkeypatch.delenv(vllm.API_KEY_ENV, raising=False)
    s = serve("vllm", VLLM_FLAGS)
    assert call(s.port, "POST", "/v1/completions", BODY, auth="Bearer anything")[0] == 200
    assert call(s.port, "POST", "/v1/completions", BODY)[0] == 200


def test_sglang_guards_all_but_health_ready_metrics(serve, monkeypatch):
    monkeypatch.setenv(vllm.API_KEY_ENV, "ignored-by-sglang")
    s = serve("sglang", {**SGLANG_FLAGS, "api-key": KEY})
    gen = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    for method, path, body in (("POST", "/generate", gen), ("POST", "/v1/completions", BODY),
                               ("GET", "/server_info", None), ("GET", "/get_server_info", None),
                               ("GET", "/model_info", None), ("GET", "/v1/models", None)):
        assert_unauthorized(s.port, method, path, body)
        assert_unauthorized(s.port, method, path, body, auth="Bearer nope")
        status, text = call(s.port, method, path, body, auth=f"Bearer {KEY}")
        assert status == 200, (path, text)
        assert KEY not in text, path  # /server_info shows the server args, never the key
    for path in ("/health", "/health_generate", "/metrics"):
        assert call(s.port, "GET", path)[0] == 200, path


def test_dialect_auth_rules():
    assert vllm.auth_required("POST", "/v1/completions") and not vllm.auth_required("OPTIONS", "/v1/completions")
    assert not any(vllm.auth_required("GET", p) for p in ("/health", "/metrics", "/version", "/load"))
    assert sglang.auth_required("GET", "/server_info") and sglang.auth_required("POST", "/generate")
    assert not any(sglang.auth_required("GET", p) for p in ("/health_generate", "/ready", "/metrics"))
    assert vllm.bearer_token(f"Bearer {KEY}") == KEY and vllm.bearer_token(f"Token {KEY}") is None
    assert sglang.bearer_token("Bearer") is None and sglang.bearer_token(f"bearer {KEY}") == KEY


def test_flags_render_for_the_real_engines():
    argv = vllm.launch_command("m", {"api-key": KEY, "disable-log-stats": True}, host="h", port=1)
    assert argv[-3:] == ["--api-key", KEY, "--disable-log-stats"]
    assert vllm.launch_command("m", {"disable-log-stats": False}, host="h", port=1)[-1] == "1"
    assert sglang.launch_command("m", {"api-key": KEY}, host="h", port=1)[-2:] == ["--api-key", KEY]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_repr_never_shows_the_key(engine):
    flags = {**(VLLM_FLAGS if engine == "vllm" else SGLANG_FLAGS), "api-key": KEY}
    settings = Settings(engine=engine, flags=flags)
    emu = Emulator(settings)
    for text in (repr(settings), str(settings), repr(emu), repr(emu.api_key), repr(emu.flags)):
        assert KEY not in text, text
    assert "api-key" in repr(settings)  # redacted, not dropped
    if engine == "sglang":
        assert KEY not in json.dumps(emu.server_info())


@pytest.mark.parametrize("how", ["flag", "env"])
def test_key_not_in_emulator_output(tmp_path, how):
    """A real `kvprobe emulate vllm` process: the key is in no line it prints, start to shutdown."""
    argv = [sys.executable, "-m", "kvprobe", "emulate", "vllm", "--num-gpu-blocks-override", "100",
            "--max-model-len", "512", "--port", "0"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(vllm.API_KEY_ENV, None)
    if how == "flag":
        argv += ["--api-key", KEY]
    else:
        env[vllm.API_KEY_ENV] = KEY
    log = tmp_path / "emu.log"
    with open(log, "wb") as fh:
        p = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            deadline = time.monotonic() + 20
            while "Starting vLLM API server" not in log.read_text():
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            port = int(log.read_text().split("http://127.0.0.1:")[1].split()[0])
            assert_unauthorized(port, "POST", "/v1/completions", BODY)
            assert call(port, "POST", "/v1/completions", BODY, auth=f"Bearer {KEY}")[0] == 200
            os.killpg(p.pid, signal.SIGTERM)
            assert p.wait(5) == 0
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
    text = log.read_text()
    assert "shut down" in text and KEY not in text, text
