"""Dialect modules against real engine output (tests/data/engine_fixtures) and their own round trips."""

from __future__ import annotations

import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvprobe.engines import get_dialect, sglang, vllm
from kvprobe.errors import ConfigError
from tests.engine_fixtures import fixture_text as fixture


def test_get_dialect():
    assert get_dialect("vllm") is vllm and get_dialect("SGLang") is sglang
    with pytest.raises(ConfigError, match="unknown engine 'trt'"):
        get_dialect("trt")
    assert (vllm.DEFAULT_PORT, sglang.DEFAULT_PORT) == (8000, 30000)


@pytest.mark.parametrize("name,want", [
    ("vllm-0.33.0-startup.log", (58336, 8192, 7.12, 8192, None)),
    ("vllm-0.33.0-startup-autofit.log", (58336, 58320, 1.0, 8192, None)),
    ("vllm-0.33.0-startup-override.log", (32768, 8192, 4.0, 8192, 2048)),
])
def test_vllm_parse_startup_fixtures(name, want):
    rep = vllm.parse_startup_log(fixture(name))
    assert (rep.kv_tokens, rep.max_model_len, rep.max_concurrency, rep.token_budget, rep.num_blocks) == want


@pytest.mark.parametrize("version", ["0.33.0", "0.11.0", "0.9.2"])
def test_vllm_capacity_lines_round_trip(version):
    lines = vllm.capacity_lines(3646, 16, 8192, version)
    assert len(lines) == (1 if version == "0.33.0" else 2)
    rep = vllm.parse_startup_log("\n".join(lines))
    assert (rep.kv_tokens, rep.max_model_len, rep.max_concurrency) == (58336, 8192, 7.12)


def test_vllm_capacity_line_matches_fixture_text():
    line = vllm.capacity_lines(3646, 16, 8192)[0]
    real = [x for x in fixture("vllm-0.33.0-startup.log").splitlines() if "KV cache size" in x][0]
    assert line.split("] ", 1)[1] == real.split("] ", 1)[1]
    assert line.split(" INFO ")[0].startswith("(EngineCore pid=")


def test_vllm_refusal_text_matches_fixture():
    # the fixture's toosmall scenario: 3646 blocks of 2 MiB, max_model_len 131072 -> estimated 58320
    msg = vllm.startup_refusal(3646, 16, 131072)
    assert "the estimated maximum model length is 58320." in msg
    assert msg.startswith("To serve at least one request with the model's max seq len (131072), (16.0 GiB")
    assert vllm.startup_refusal(257, 16, 4096) is None and vllm.startup_refusal(256, 16, 4096)


def test_vllm_reported_from_metrics_fixture():
    fams = {f.name: f for f in text_string_to_metric_families(fixture("vllm-0.33.0-metrics.txt"))}
    rep = vllm.reported_from_metrics(fams)
    assert (rep.num_blocks, rep.block_size, rep.kv_tokens, rep.max_concurrency) == (3646, 16, 58336, 7.12109375)
    for role in ("running", "waiting", "usage", "preemptions", "ttft", "success"):
        assert getattr(vllm.METRICS, role) in fams, role
    assert vllm.METRICS.waiting_capacity[0] in fams


def test_vllm_cache_config_labels_match_fixture():
    fams = {f.name: f for f in text_string_to_metric_families(fixture("vllm-0.33.0-metrics.txt"))}
    real = fams["vllm:cache_config_info"].samples[0].labels
    ours = vllm.cache_config_labels(num_gpu_blocks=3646, block_size=16, max_model_len=8192,
                                    enable_prefix_caching=True, num_gpu_blocks_override=None)
    assert ours == real


def test_vllm_length_checks_and_versions():
    assert vllm.check_lengths(8000, 512, 0, 8192) == (192, None)
    _, err = vllm.check_lengths(8000, 512, 512, 8192)
    assert err == {"error": {"message": "min_tokens must be less than or equal to max_tokens=192, got 512.",
                             "type": "BadRequestError", "param": None, "code": 400}}
    _, err = vllm.check_lengths(8000, 512, 0, 8192, version="0.11.0")
    assert err["error"]["message"].startswith("This model's maximum context length is 7680 tokens.")
    assert vllm.error_body("x", version="0.9.2")["object"] == "error"
    # entrypoints/openai/protocol.py ErrorResponse: flat in 0.10.0 (L80-85), nested from 0.10.1 (L90-98)
    assert vllm.error_body("x", version="0.10.0")["object"] == "error"
    assert vllm.error_body("x", version="0.10.1")["error"]["message"] == "x"
    assert (vllm.policy("0.33.0"), vllm.policy("0.11.0"), vllm.policy("0.33.0", reserve_full_isl=False)) == (
        "vllm-0.33", "vllm-0.11", "vllm-0.11")


def test_sglang_parse_every_real_quote():
    text = fixture("sglang-startup-real-quotes.log")
    for line in text.splitlines():
        rep = sglang.parse_startup_log(line)
        if "max_total_num_tokens=" not in line and "#tokens:" not in line:
            assert rep.kv_tokens is None, line  # "Memory pool end", old KV line without #tokens
            continue
        assert rep.kv_tokens and rep.kv_tokens > 0, line
        if "max_total_num_tokens=" in line:
            assert rep.max_model_len and rep.max_running, line
    rep = sglang.parse_startup_log(text)  # the last capacity line of the file wins
    assert (rep.kv_tokens, rep.token_budget, rep.max_running, rep.max_model_len) == (298447, 2048, 3730, 40960)
    old = sglang.parse_startup_log("[2024-12-13 01:45:02 TP0] max_total_num_tokens=56524, max_prefill_tokens=16384, "
                                   "max_running_requests=2049, context_len=32768")
    assert (old.kv_tokens, old.token_budget, old.max_running) == (56524, None, 2049)


def test_sglang_startup_line_round_trip_and_fixture():
    rep = sglang.parse_startup_log(fixture("sglang-0.5.23-startup.log"))
    assert (rep.kv_tokens, rep.token_budget, rep.max_running, rep.max_model_len) == (444500, 8192, 2048, 131072)
    ours = sglang.capacity_line(max_total_num_tokens=444500, chunked_prefill_size=8192, max_prefill_tokens=16384,
                                max_running_requests=2048, context_len=131072, available_gpu_mem=7.63)
    real = fixture("sglang-0.5.23-startup.log").splitlines()[2]
    assert ours.split("] ", 1)[1] == real.split("] ", 1)[1]


def test_sglang_reported_from_metrics_fixture():
    fams = {f.name: f for f in text_string_to_metric_families(fixture("sglang-0.5.23-metrics.txt"))}
    rep = sglang.reported_from_metrics(fams)
    assert (rep.kv_tokens, rep.max_model_len, rep.block_size) == (444500, 131072, 1)
    for role in ("running", "waiting", "usage", "used_tokens", "pool_tokens", "ttft"):
        assert getattr(sglang.METRICS, role) in fams, role


def test_sglang_length_checks():
    assert sglang.check_tokenizer(1000, 256, 512, 131072) == (
        "min_new_tokens must be in [0, max_new_tokens(256)], got 512.")
    assert sglang.check_scheduler(50000, sglang.max_req_input_len(131072, 46611)).startswith(
        "Input length (50000 tokens) exceeds the maximum allowed length (46605 tokens).")
    # page 1: output <= min(context_len, M) - input - 2
    assert sglang.clip_max_new(100, 10_000, context_len=1000, max_total_num_tokens=5000) == 898
    assert (sglang.policy("0.5.21"), sglang.policy("0.5.23")) == ("sglang-0.5.21", "sglang-0.5.22")


def test_commands_and_bodies():
    cmd = vllm.launch_command("m", {"max-num-seqs": 8, "enable-prefix-caching": False, "gpu-memory-utilization": 0.9},
                              host="127.0.0.1", port=8123)
    assert cmd == ["vllm", "serve", "m", "--host", "127.0.0.1", "--port", "8123", "--max-num-seqs", "8",
                   "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.9"]
    emu = vllm.emulator_command("m", {"num-gpu-blocks-override": 100, "gpu-memory-utilization": 0.9},
                                host="127.0.0.1", port=1, extra=["--step-ms", "1"])
    assert emu[:5] == [sys.executable, "-m", "kvprobe", "emulate", "vllm"]
    assert "--gpu-memory-utilization" not in emu and emu[-2:] == ["--step-ms", "1"]
    with pytest.raises(ConfigError, match="num-gpu-blocks-override"):
        vllm.emulator_command("m", {}, host="h", port=1)
    sg = sglang.launch_command("m", {"disable-radix-cache": True, "enable-metrics": False}, host="h", port=2)
    assert sg == ["python", "-m", "sglang.launch_server", "--model-path", "m", "--host", "h", "--port", "2",
                  "--disable-radix-cache"]
    assert "--enable-metrics" in sglang.emulator_command("m", {"max-total-tokens": 10}, host="h", port=2)
    body = vllm.completion_body([1, 2], 5, model="m")
    assert body["min_tokens"] == body["max_tokens"] == 5 and body["ignore_eos"] and body["stream_options"]
    assert "stream_options" not in sglang.completion_body([1], 3, model=None, stream=False)
