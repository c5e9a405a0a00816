"""The wire: endpoints, streaming and not, prompts, exact usage, error bodies as in fixtures/errors.md."""

from __future__ import annotations

import json

from kvprobe.targets.emulator.tokens import text_to_ids
from tests.engine_fixtures import FIXTURES

VLLM = {"num-gpu-blocks-override": 1000, "max-model-len": 8192, "served-model-name": "meta-llama/Llama-3.1-8B-Instruct"}


def fixture_bodies(section: str) -> list[dict]:
    """The JSON error bodies of one engine part of errors.md, in order."""
    text = (FIXTURES / "errors.md").read_text()
    vllm_part, sglang_part = text.split("## SGLang 0.5.23", 1)
    part = vllm_part if section == "vllm" else sglang_part.split("## Appendix A", 1)[0]
    return [json.loads(block.split("```", 1)[0]) for block in part.split("```json\n")[1:]]


def test_vllm_nonstream_token_ids_exact_usage(serve):
    s = serve("vllm", VLLM)
    status, text = s.post("/v1/completions", {"prompt": list(range(1, 101)), "max_tokens": 7, "min_tokens": 7,
                                              "ignore_eos": True})
    assert status == 200, text
    body = json.loads(text)
    assert body["usage"] == {"prompt_tokens": 100, "total_tokens": 107, "completion_tokens": 7,
                             "prompt_tokens_details": None, "completion_tokens_details": None}
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(body["choices"][0]["text"].split()) == 7


def test_vllm_0340_publishes_an_unresolved_utilisation_and_no_prompt_tokens_details(serve):
    # 0.34.0 keeps CacheConfig.gpu_memory_utilization None unless given (config/cache.py L216) and leaves a
    # None prompt_tokens_details out of usage (protocol.py L139-141); 0.33.0 publishes 0.92 and null
    def seen(version, flags):
        s = serve("vllm", {**VLLM, **flags}, version=version)
        label = s.families()["vllm:cache_config_info"].samples[0].labels["gpu_memory_utilization"]
        info = s.emu.dev_server_info()  # /server_info in dev mode
        status, text = s.post("/v1/completions", {"prompt": [5] * 10, "max_tokens": 2, "min_tokens": 2,
                                                  "ignore_eos": True})
        assert status == 200, text
        return label, info["vllm_config"]["cache_config"]["gpu_memory_utilization"], json.loads(text)["usage"]

    label, published, usage = seen("0.34.0", {})
    assert (label, published) == ("None", None) and "prompt_tokens_details" not in usage
    assert seen("0.34.0", {"gpu-memory-utilization": 0.8})[:2] == ("0.8", 0.8)
    label, published, usage = seen("0.33.0", {})
    assert (label, published) == ("0.92", 0.92) and usage["prompt_tokens_details"] is None


def test_vllm_stream_shapes_and_usage(serve):
    s = serve("vllm", VLLM)
    status, events = s.sse("/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 5, "min_tokens": 5,
                                               "ignore_eos": True, "stream": True,
                                               "stream_options": {"include_usage": True}})
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [c for c in chunks if c["choices"]]
    assert len(tokens) == 5
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 4 + ["length"]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in tokens)
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["prompt_tokens"] == len(text_to_ids("the quick brown fox"))
    assert final["usage"]["completion_tokens"] == 5


def test_text_rule_is_whitespace_split_and_deterministic():
    assert len(text_to_ids("a b  c\nd")) == 4
    assert text_to_ids("hello world") == text_to_ids("hello   world")
    assert text_to_ids("hello") != text_to_ids("world")


def test_pseudo_eos_without_ignore_eos(serve):
    s = serve("vllm", VLLM, seed=3)
    counts = []
    for i in range(12):
        status, text = s.post("/v1/completions", {"prompt": [i + 1] * 20, "max_tokens": 30, "min_tokens": 4})
        body = json.loads(text)
        n = body["usage"]["completion_tokens"]
        assert 4 <= n <= 30
        assert body["choices"][0]["finish_reason"] == ("length" if n == 30 else "stop")
        counts.append(n)
    assert min(counts) < 30, "with 12 requests at least one pseudo-EOS is expected (seeded)"


def test_vllm_error_bodies_match_fixture(serve):
    s = serve("vllm", VLLM)
    want = fixture_bodies("vllm")
    cases = [  # the requests of errors.md, in the same order as its JSON blocks
        ({"prompt": [1000] * 9000, "max_tokens": 16}, 400),
        ({"prompt": [1000] * 9000, "max_tokens": 16, "stream": True}, 400),
        ({"prompt": [1000] * 8193, "max_tokens": 16}, 400),
        ({"prompt": [1000] * 8192, "max_tokens": 16}, 400),
        ({"prompt": [1000] * 8000, "max_tokens": 512, "min_tokens": 512, "ignore_eos": True}, 400),
        ({"prompt": [1000] * 8000, "max_tokens": 512, "min_tokens": 512, "ignore_eos": True, "stream": True}, 400),
        (None, None),  # §4: the 200 of a clamped request, checked below
        ({"prompt": [1000] * 100, "max_tokens": 9000}, 400),
    ]
    assert len(want) == len(cases)
    for (req, code), body in zip(cases, want, strict=True):
        if req is None:
            continue
        status, text = s.post("/v1/completions", {"model": "meta-llama/Llama-3.1-8B-Instruct", **req})
        assert (status, json.loads(text)) == (code, body)


def test_vllm_clamps_max_tokens_silently(serve):
    s = serve("vllm", {**VLLM, "max-model-len": 256, "num-gpu-blocks-override": 100})
    status, text = s.post("/v1/completions", {"prompt": [5] * 250, "max_tokens": 100, "ignore_eos": True})
    assert status == 200
    body = json.loads(text)
    assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"


def test_vllm_011_rejects_instead_of_clamping(serve):
    s = serve("vllm", {**VLLM, "max-model-len": 256, "num-gpu-blocks-override": 100}, version="0.11.0")
    status, text = s.post("/v1/completions", {"prompt": [5] * 250, "max_tokens": 100})
    assert status == 400
    assert json.loads(text)["error"]["message"].startswith("This model's maximum context length is 156 tokens.")


def test_vllm_other_rejections(serve):
    s = serve("vllm", VLLM)
    status, text = s.post("/v1/completions", {"model": "nope", "prompt": [1], "max_tokens": 1})
    assert status == 404 and json.loads(text)["error"]["type"] == "NotFoundError"
    status, text = s.post("/v1/completions", {"prompt": [1], "stream_options": {"include_usage": True}})
    assert status == 400 and "Stream options" in json.loads(text)["error"]["message"]
    status, text = s.post("/v1/completions", {"prompt": {"x": 1}})
    assert status == 400 and json.loads(text)["error"]["type"] == "Bad Request"


def test_vllm_info_endpoints(serve):
    s = serve("vllm", VLLM)
    from kvprobe.engines import vllm

    assert s.request("GET", "/health")[::2] == (200, "")
    status, _, text = s.request("GET", "/v1/models")
    assert vllm.reported_from_info("/v1/models", json.loads(text)).max_model_len == 8192
    status, _, text = s.request("GET", "/version")
    assert vllm.reported_from_info("/version", json.loads(text)).version == "0.33.0"


SGL = {"max-total-tokens": 46611, "context-length": 131072, "enable-metrics": True}


def test_sglang_error_bodies_match_fixture(serve):
    s = serve("sglang", SGL)
    want = fixture_bodies("sglang")
    cases = [  # (prompt length, max_tokens, min_tokens) of errors.md in order; each gives /v1 then /generate
        (131073, 16, 0), (131072, 16, 0), (130000, 2048, 0), (130000, 2048, 2048), (1000, 256, 512),
        (50000, 1024, 0)]
    assert len(want) >= 2 * len(cases)
    for (n, mx, mn), v1, gen in zip(cases, want[0::2], want[1::2], strict=False):
        status, text = s.post("/v1/completions", {"prompt": [7] * n, "max_tokens": mx, "min_tokens": mn})
        assert (status, json.loads(text)) == (400, v1)
        status, text = s.post("/generate", {"input_ids": [7] * n,
                                            "sampling_params": {"max_new_tokens": mx, "min_new_tokens": mn}})
        assert (status, json.loads(text)) == (400, gen)


def test_sglang_stream_scheduler_abort_is_200_sse(serve):
    s = serve("sglang", SGL)
    status, events = s.sse("/v1/completions", {"prompt": [7] * 50000, "max_tokens": 1024, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[0])["error"]["type"] == "BAD_REQUEST"


def test_sglang_completion_generate_and_info(serve):
    s = serve("sglang", {"max-total-tokens": 4000, "context-length": 2048})
    from kvprobe.engines import sglang

    status, events = s.sse("/v1/completions", {"prompt": [3] * 40, "max_tokens": 6, "min_tokens": 6, "ignore_eos": True,
                                               "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and json.loads(events[-2])["usage"]["completion_tokens"] == 6
    status, text = s.post("/generate", {"input_ids": [3] * 40, "sampling_params": {"max_new_tokens": 4,
                                                                                  "ignore_eos": True}})
    assert status == 200 and json.loads(text)["meta_info"]["completion_tokens"] == 4
    status, _, text = s.request("GET", "/server_info")
    rep = sglang.reported_from_info("/server_info", json.loads(text))
    assert (rep.kv_tokens, rep.max_req_input_len, rep.max_running) == (4000, 2042, 2000)
    status, _, text = s.request("GET", "/metrics")
    assert status == 404, "SGLang serves /metrics only with --enable-metrics"


def test_disconnect_aborts_and_frees_blocks(serve):
    from tests.emulator.conftest import StreamClients, wait_for

    s = serve("vllm", {"num-gpu-blocks-override": 200, "max-model-len": 4096})
    clients = StreamClients(s.url, [{"prompt": [i + 1] * 100, "max_tokens": 3000, "ignore_eos": True, "stream": True}
                                    for i in range(5)])
    wait_for(lambda: s.value("vllm:num_requests_running") == 5, what="5 running")
    assert s.value("vllm:kv_cache_usage_perc") > 0
    clients.cancel()
    wait_for(lambda: s.value("vllm:num_requests_running") == 0, what="aborts")
    assert s.value("vllm:kv_cache_usage_perc") == 0.0
    assert s.value("vllm:request_success", finished_reason="abort") == 5
    s.call(s.emu.scheduler.check_pool)  # no block leaked
