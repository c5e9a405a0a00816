"""What engines publish about themselves, parsed by the dialect modules: against what a real vLLM
0.33.0 server published (tests/engines/published/, captured from `vllm serve` with kvprobe's
model-less worker; see README there), and the emulator against the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvprobe.engines import get_dialect, sglang, vllm
from kvprobe.observe.http import http_get
from kvprobe.procgroup import free_port
from kvprobe.targets.facts import merge_reports
from kvprobe.targets.launch import Target

PUBLISHED = Path(__file__).resolve().parent / "published"
# The flags the real server was started with (README.md in published/).
REAL_FLAGS = {"served-model-name": "staging-llama", "num-gpu-blocks-override": 1000, "block-size": 16,
              "max-model-len": 4096, "max-num-seqs": 16, "max-num-batched-tokens": 2048}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def real_vllm_reports() -> list:
    """The real server's answers in the order `Target.facts` reads them."""
    reports = [("metrics", vllm.reported_from_metrics(
        families((PUBLISHED / "vllm-0.33.0-cache_config_info.txt").read_text())))]
    for path, name in (("/v1/models", "v1-models"), ("/version", "version"),
                       ("/server_info?config_format=json", "server_info")):
        body = json.loads((PUBLISHED / f"vllm-0.33.0-{name}.json").read_text())
        reports.append((f"GET {path}", vllm.reported_from_info(path, body)))
    return reports


def test_real_vllm_models_and_version():
    models = json.loads((PUBLISHED / "vllm-0.33.0-v1-models.json").read_text())
    rep = vllm.reported_from_info("/v1/models", models)
    assert (rep.served_model_name, rep.max_model_len, rep.flags) == ("staging-llama", 4096, {"max-model-len": 4096})
    assert rep.model_path.endswith("/meta-llama-Llama-3.1-8B-5709a6a5da73")
    assert rep.sources["flags.max-model-len"] == "/v1/models"
    assert vllm.reported_from_info("/version", {"version": "0.33.0"}).version == "0.33.0"


def test_real_vllm_cache_config_info_gives_the_cache_flags():
    rep = vllm.reported_from_metrics(families((PUBLISHED / "vllm-0.33.0-cache_config_info.txt").read_text()))
    assert rep.flags == {"block-size": 16, "num-gpu-blocks-override": 1000, "gpu-memory-utilization": 0.92,
                         "kv-cache-memory-bytes": None, "kv-cache-dtype": "auto", "enable-prefix-caching": True}
    assert (rep.num_blocks, rep.kv_tokens, rep.max_concurrency) == (1000, 16000, 3.90625)


def test_real_vllm_dev_server_info_gives_the_scheduler_limits():
    body = json.loads((PUBLISHED / "vllm-0.33.0-server_info.json").read_text())
    rep = vllm.reported_from_info("/server_info?config_format=json", body)
    assert (rep.max_running, rep.token_budget, rep.num_blocks, rep.served_model_name) == (
        16, 2048, 1000, "staging-llama")
    want = {"max-num-seqs": 16, "max-num-batched-tokens": 2048, "enable-chunked-prefill": True, "watermark": 0.0,
            "scheduler-reserve-full-isl": True, "async-scheduling": False, "block-size": 16,
            "num-gpu-blocks-override": 1000,
            "gpu-memory-utilization": 0.92, "kv-cache-dtype": "auto", "kv-cache-memory-bytes": None,
            "enable-prefix-caching": True, "tensor-parallel-size": 1, "pipeline-parallel-size": 1,
            "data-parallel-size": 1, "max-model-len": 4096, "dtype": "bfloat16", "quantization": None,
            "max-num-active-seqs": None, "enable-expert-parallel": False, "enforce-eager": False,
            "gdn-prefill-backend": None}  # additional_config {}: the platform's choice
    assert rep.flags == want
    # the flag given: its additional_config as the same release's server dumps it (the fixture's README)
    body["vllm_config"]["additional_config"] = {"gdn_prefill_backend": "triton"}
    assert vllm.reported_from_info("/server_info?config_format=json", body).flags["gdn-prefill-backend"] == "triton"
    # every published flag is one an expectation can write, under the same name
    assert set(rep.flags) <= set(vllm.FLAGS)
    # config_format=text is one str(VllmConfig): nothing is read from it
    assert vllm.reported_from_info("/server_info", {"vllm_config": "ModelConfig(...)"}).flags == {}


def test_the_emulator_publishes_what_real_vllm_publishes(tmp_path):
    """Same flags as the real capture: the emulator's /v1/models, /version, cache_config_info and
    dev-mode /server_info read back to the same facts, and the same cache_config_info labels."""
    real, _ = merge_reports(real_vllm_reports())
    port = free_port()
    argv = vllm.emulator_command("/models/llama", REAL_FLAGS, host="127.0.0.1", port=port)
    with Target.launch(argv, engine="vllm", port=port, log_path=str(tmp_path / "engine.log"), startup_timeout=60,
                       env={vllm.DEV_MODE_ENV: "1"}) as target:
        facts = target.facts()
        _, text = http_get(target.url + "/metrics")
    rep = facts.reported
    assert facts.errors == []
    assert rep.flags == real.flags
    for name in ("served_model_name", "max_model_len", "num_blocks", "kv_tokens", "max_running", "token_budget",
                 "version", "block_size", "max_concurrency"):
        assert getattr(rep, name) == getattr(real, name), name
    mine = families(text.decode())["vllm:cache_config_info"].samples[0].labels
    theirs = families((PUBLISHED / "vllm-0.33.0-cache_config_info.txt").read_text())[
        "vllm:cache_config_info"].samples[0].labels
    # mamba_ssm_cache_dtype: the capture ran on vLLM's CPU platform (float32); a GPU shows "auto"
    # (tests/data/engine_fixtures/vllm-0.33.0-metrics-idle.txt), as the emulator does.
    differ = {k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)}
    assert differ == {"mamba_ssm_cache_dtype"}


def test_without_dev_mode_vllm_publishes_no_scheduler_limits(tmp_path):
    port = free_port()
    argv = vllm.emulator_command("m", REAL_FLAGS, host="127.0.0.1", port=port)
    with Target.launch(argv, engine="vllm", port=port, log_path=str(tmp_path / "engine.log"),
                       startup_timeout=60) as target:
        facts = target.facts()
        status, _ = http_get(target.url + "/server_info")
    assert status == 404 and facts.errors == []  # an optional endpoint: its absence is no error
    assert "max-num-seqs" not in facts.reported.flags
    # ... but a launched vLLM logs the arguments it was given (startup.py L94-96): the cap is read there
    assert facts.reported.max_running == 16 and facts.reported.sources["max_running"] == "startup log: non-default args"
    assert facts.reported.flags["block-size"] == 16


def test_sglang_server_info_holds_every_server_argument(tmp_path):
    """/server_info is ServerArgs.resolved_dict(): every argument, unset ones as null
    (SGLang 0.5.23 http_server.py and server_args.py); the emulator's has every flag kvprobe knows."""
    port = free_port()
    flags = {"max-total-tokens": 3300, "context-length": 2048, "max-running-requests": 12, "page-size": 1}
    argv = sglang.emulator_command("/models/qwen", {**flags, "served-model-name": "qwen"}, host="127.0.0.1",
                                   port=port)
    with Target.launch(argv, engine="sglang", port=port, log_path=str(tmp_path / "engine.log"),
                       startup_timeout=60) as target:
        facts = target.facts()
        _, body = http_get(target.url + "/server_info")
    info = json.loads(body)
    assert {f.dest for n, f in sglang.FLAGS.items() if n != "api-key"} <= set(info)
    assert (info["model_path"], info["served_model_name"]) == ("/models/qwen", "qwen")
    rep = facts.reported
    assert (rep.served_model_name, rep.model_path, rep.max_running, rep.kv_tokens) == ("qwen", "/models/qwen", 12, 3300)
    assert {k: rep.flags[k] for k in flags} == flags
    assert rep.flags["mem-fraction-static"] is None and rep.flags["disable-radix-cache"] is False
    assert rep.sources["flags.context-length"] == "/server_info"


def test_sglang_unset_context_length_is_not_published():
    rep = sglang.reported_from_info("/server_info", {"context_length": None, "max_running_requests": None,
                                                     "max_total_tokens": None, "page_size": 1})
    assert "context-length" not in rep.flags  # the model's own length: /v1/models' max_model_len
    assert rep.flags["max-running-requests"] is None and rep.flags["max-total-tokens"] is None
    models = sglang.reported_from_info("/v1/models", {"data": [{"id": "q", "root": "q", "max_model_len": 4096}]})
    assert models.flags == {"context-length": 4096} and models.served_model_name == "q"


@pytest.mark.parametrize("engine,log,line", [
    ("vllm", "vllm-0.33.0-unknown-flag.log", "vllm: error: unrecognized arguments: --bogus-flag 3"),
    ("sglang", "sglang-0.5.23-unknown-flag.log", "sglang serve: error: unrecognized arguments: --bogus-flag 3"),
])
def test_the_engines_own_refusal_of_an_unknown_flag(engine, log, line):
    text = (PUBLISHED / log).read_text()
    assert get_dialect(engine).startup_refusal_line(text) == line
    assert get_dialect(engine).startup_refusal_line("INFO all good\n") is None


def test_vllm_pool_refusal_line():
    text = "Traceback...\nValueError: To serve at least one request with the model's max seq len (131072), ...\n"
    assert vllm.startup_refusal_line(text).startswith("ValueError: To serve at least one request")


def test_vllm_other_refusals_name_the_engine_cores_exception_not_its_echo():
    text = ("(EngineCore pid=7) WARNING 12-01 10:57:47 [cpu.py:670] Failed to import from vllm._C: "
            "ModuleNotFoundError(x)\n"
            "(EngineCore pid=7) ERROR 12-01 10:57:47 [core.py:1584] "
            "kvprobe.targets.shadow.vllm.kvspec.UnsupportedModelError: "
            "kvprobe's shadow worker cannot describe this model's KV cache\n"
            "Traceback (most recent call last):\n"
            "kvprobe.targets.shadow.vllm.kvspec.UnsupportedModelError: "
            "kvprobe's shadow worker cannot describe this model's KV cache\n"
            + vllm.STARTUP_FAILED.format("{'EngineCore': 1}") + "\n")
    assert vllm.startup_refusal_line(text) == (
        "kvprobe.targets.shadow.vllm.kvspec.UnsupportedModelError: kvprobe's shadow "
        "worker cannot describe this model's KV cache")


def test_launch_with_a_served_name():
    argv = vllm.launch_command("/models/llama-8b", {"max-num-seqs": 16}, host="127.0.0.1", port=8000,
                               served_model_name="llama-8b")
    assert argv[:3] == ["vllm", "serve", "/models/llama-8b"]
    assert argv[argv.index("--served-model-name") + 1] == "llama-8b"
    argv = sglang.launch_command("/models/llama-8b", {}, host="127.0.0.1", port=30000, served_model_name="llama-8b")
    assert argv[argv.index("--model-path") + 1] == "/models/llama-8b"
    assert argv[argv.index("--served-model-name") + 1] == "llama-8b"
    # the same name as the model: no flag (both engines default the served name to the model)
    assert "--served-model-name" not in vllm.launch_command("m", {}, host="h", port=1, served_model_name="m")
    # a served name already in the flags (the shadow targets pass it there) is rendered once
    argv = vllm.launch_command("p", {"served-model-name": "n"}, host="h", port=1, served_model_name="n")
    assert argv.count("--served-model-name") == 1
