"""The probe's own single requests (calibration shots, the length-limit check) through the `openai`
client: both engines' bodies (token-id prompts, min_tokens/ignore_eos as extra fields, streaming
usage), the engine's refusal kept as its status and body, a refused API key said as the key, and
nothing taken from the user's OPENAI_* or proxy environment. Against kvprobe's emulators of both
engines over real HTTP."""

from __future__ import annotations

import json

import pytest

from kvprobe.engines import get_dialect
from kvprobe.errors import ConfigError
from kvprobe.load.prompts import as_prompt_format
from kvprobe.observe.oneshot import post_completion, unique_prompt
from kvprobe.procgroup import free_port
from tests.cli.console import FLAGS
from tests.emulator.conftest import FAST, Served

KEY = "sk-shot-41c9"


def _served(engine: str, **extra):
    from kvprobe.targets.emulator.app import Settings

    return Served(Settings(engine=engine, model="test/model", flags={**FLAGS[engine], **extra}, time_model=FAST))


@pytest.fixture(params=["vllm", "sglang"])
def engine(request):
    served = _served(request.param)
    yield request.param, served
    served.stop()


@pytest.fixture(params=["vllm", "sglang"])
def guarded(request):
    served = _served(request.param, **{"api-key": KEY})
    yield request.param, served
    served.stop()


def _body(engine: str, prompt: int, output: int, *, stream: bool, model: str | None = "test/model") -> dict:
    return get_dialect(engine).completion_body(unique_prompt(prompt, 1), output, model=model, stream=stream)


@pytest.mark.parametrize("stream", [True, False])
def test_a_fixed_length_shot_counts_what_the_engine_says(engine, stream):
    name, served = engine
    shot = post_completion(served.url, _body(name, 100, 20, stream=stream, model=None),
                           path=get_dialect(name).COMPLETIONS_PATH)
    assert (shot.status, shot.prompt_tokens, shot.completion_tokens, shot.body) == (200, 100, 20, "")
    assert (shot.ttft is not None) is stream and (not stream or 0 < shot.ttft <= shot.seconds)


def test_a_text_prompt_behind_a_router(engine):
    name, served = engine
    body = as_prompt_format(_body(name, 30, 5, stream=True), "text")
    shot = post_completion(served.url, body, path=get_dialect(name).COMPLETIONS_PATH)
    assert (shot.status, shot.completion_tokens) == (200, 5)


def test_the_engines_refusal_is_its_status_and_body(engine):
    name, served = engine
    shot = post_completion(served.url, _body(name, 1020, 20, stream=False), path=get_dialect(name).COMPLETIONS_PATH)
    assert shot.status == 400 and not shot.ok
    said = json.loads(shot.body)
    message = said["error"]["message"] if name == "vllm" else said["message"]  # each engine's own error shape
    assert ("min_tokens" in message) if name == "vllm" else ("maximum context length of 1024" in message)


def test_a_missing_key_is_said_as_the_key(guarded, monkeypatch):
    name, served = guarded
    # the user's own OpenAI settings never reach an engine: no key is sent, and the URL is the engine's
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{free_port()}/v1")
    with pytest.raises(ConfigError) as err:
        post_completion(served.url, _body(name, 10, 2, stream=True), path=get_dialect(name).COMPLETIONS_PATH)
    assert str(err.value) == (
        f"--api-key-env (or target.api_key_env): the engine at {served.url} answered HTTP 401 to POST "
        "/v1/completions: it was started with an API key (--api-key) and kvprobe sent none; put the key in an "
        "environment variable and name that variable in --api-key-env (or target.api_key_env)")


def test_a_refused_key_is_said_and_never_shown(guarded):
    name, served = guarded
    with pytest.raises(ConfigError) as err:
        post_completion(served.url, _body(name, 10, 2, stream=False), path=get_dialect(name).COMPLETIONS_PATH,
                        headers={"Authorization": "Bearer sk-wrong"})
    assert "answered HTTP 401 to POST /v1/completions: it refused the API key kvprobe sent" in str(err.value)
    assert "sk-wrong" not in str(err.value)


def test_the_key_and_no_proxy(guarded, monkeypatch):
    name, served = guarded
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")  # nothing listens: a proxy would fail
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    shot = post_completion(served.url, _body(name, 10, 2, stream=True), path=get_dialect(name).COMPLETIONS_PATH,
                           headers={"Authorization": f"Bearer {KEY}"})
    assert (shot.status, shot.completion_tokens) == (200, 2)


def test_no_answer_is_status_0_with_the_reason():
    shot = post_completion(f"http://127.0.0.1:{free_port()}", _body("vllm", 10, 2, stream=True),
                           path="/v1/completions", timeout=5)
    assert shot.status == 0 and shot.body.startswith("APIConnectionError: Connection error.")
    assert "onnect" in shot.body.split("(", 1)[1]  # the cause: the refused connection
