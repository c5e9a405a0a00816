"""Hypothesis fuzzing of the emulator's HTTP API: valid, near-valid and garbage bodies for /v1/completions
(both dialects) and SGLang's /generate. Every answer is a known status with a JSON body (never a 500,
never a hang), and after the run the pool is empty, the scheduler consistent and still serving."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.emulator.test_hostile import SGLANG, VLLM, assert_drained, raw

SETTINGS = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

token = st.one_of(st.integers(0, 40000), st.integers(-5, 2**33), st.integers(), st.booleans(), st.floats(),
                  st.text(max_size=3))
ints = st.one_of(st.integers(-3, 300), st.integers(), st.none(), st.floats(allow_nan=True), st.booleans(),
                 st.text(max_size=4), st.sampled_from(["3", " 7 ", "1e3", "-1"]))
bools = st.one_of(st.booleans(), st.none(), st.integers(-1, 2), st.sampled_from(["yes", "no", "maybe", "", "TRUE"]))
junk = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=8)
prompt = st.one_of(st.lists(st.integers(1, 30000), min_size=1, max_size=60), st.lists(token, max_size=8),
                   st.text(max_size=60), st.lists(st.text(max_size=10), max_size=2), junk)


@st.composite
def completion_body(draw) -> bytes:
    kind = draw(st.sampled_from(["valid", "near", "garbage"]))
    if kind == "garbage":
        return draw(st.one_of(st.binary(max_size=60), junk.map(lambda v: json.dumps(v).encode())))
    body = {"prompt": draw(st.lists(st.integers(1, 30000), min_size=1, max_size=60)),
            "max_tokens": draw(st.integers(1, 40)), "ignore_eos": draw(st.booleans()),
            "stream": draw(st.booleans())}
    if body["stream"] and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if kind == "near":  # one to three fields replaced, removed or added
        for _ in range(draw(st.integers(1, 3))):
            key = draw(st.sampled_from(["prompt", "max_tokens", "min_tokens", "ignore_eos", "stream",
                                        "stream_options", "model", "extra"]))
            strat = {"prompt": prompt, "max_tokens": ints, "min_tokens": ints, "ignore_eos": bools,
                     "stream": bools}.get(key, junk)
            if draw(st.booleans()):
                body[key] = draw(strat)
            else:
                body.pop(key, None)
    return json.dumps(body).encode()


@st.composite
def generate_body(draw) -> bytes:
    kind = draw(st.sampled_from(["valid", "near", "garbage"]))
    if kind == "garbage":
        return draw(st.one_of(st.binary(max_size=60), junk.map(lambda v: json.dumps(v).encode())))
    sp = {"max_new_tokens": draw(st.integers(0, 40)), "ignore_eos": draw(st.booleans())}
    body = {"input_ids": draw(st.lists(st.integers(1, 30000), min_size=1, max_size=60)), "sampling_params": sp,
            "stream": draw(st.booleans())}
    if kind == "near":
        for _ in range(draw(st.integers(1, 3))):
            key = draw(st.sampled_from(["input_ids", "text", "sampling_params", "max_new_tokens", "min_new_tokens",
                                        "ignore_eos", "stream"]))
            target = sp if key in ("max_new_tokens", "min_new_tokens", "ignore_eos") else body
            strat = {"input_ids": prompt, "text": prompt, "max_new_tokens": ints, "min_new_tokens": ints,
                     "ignore_eos": bools, "stream": bools}.get(key, junk)
            target[key] = draw(strat)
    return json.dumps(body).encode()


def check_answer(status: int, data: bytes, seen: dict) -> None:
    assert status in (200, 400, 404), (status, data[:300])
    seen[status] = seen.get(status, 0) + 1
    if status != 200:
        json.loads(data)  # an error is always a JSON body
    elif not data.startswith(b"data: "):
        json.loads(data)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_fuzz_completions(serve, engine):
    s = serve(engine, VLLM if engine == "vllm" else SGLANG)
    seen: dict[int, int] = {}

    @SETTINGS
    @given(completion_body())
    def one(data):
        check_answer(*raw(s.port, "/v1/completions", data, timeout=20), seen)

    one()
    assert seen.get(200) and seen.get(400), seen  # the strategies reached both sides
    assert_drained(s)


@pytest.mark.slow
def test_fuzz_generate(serve):
    s = serve("sglang", SGLANG)
    seen: dict[int, int] = {}

    @SETTINGS
    @given(generate_body())
    def one(data):
        check_answer(*raw(s.port, "/generate", data, timeout=20), seen)

    one()
    assert seen.get(200) and seen.get(400), seen
    assert_drained(s)
