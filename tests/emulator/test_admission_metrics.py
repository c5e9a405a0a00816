"""Admission seen through HTTP + /metrics agrees with schedsim in virtual time; exposition is exact."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvprobe.engines import sglang, vllm
from kvprobe.theory.schedsim import SglangConfig, SimRequest, VllmConfig, make_scheduler
from kvprobe.theory.sim.steptime import TimeModel
from tests.emulator.conftest import StreamClients, wait_for
from tests.engine_fixtures import FIXTURES

SLOW = TimeModel(step_ms=20.0, prefill_us_per_token=0.0, decode_us_per_seq=0.0)


def virtual(config, n: int, prompt: int, out: int, steps: int):
    sched = make_scheduler(config)
    for i in range(n):
        sched.add(SimRequest(rid=f"r{i}", prompt=[1000 + i] * prompt, max_tokens=out))
    for _ in range(steps):
        sched.step()
    return sched.stats.running, sched.stats.waiting


def bodies(n: int, prompt: int, out: int) -> list[dict]:
    return [{"prompt": [1000 + i] * prompt, "max_tokens": out, "min_tokens": out, "ignore_eos": True,
             "stream": True, "stream_options": {"include_usage": True}} for i in range(n)]


@pytest.mark.parametrize("flags", [
    {"num-gpu-blocks-override": 65, "max-model-len": 1024},  # KV binds
    {"num-gpu-blocks-override": 500, "max-model-len": 1024, "max-num-seqs": 4},  # max_num_seqs binds
])
def test_vllm_running_waiting_match_schedsim(serve, flags):
    n, prompt, out = 20, 100, 12  # 100 + 12 - 1 tokens fit the 7 admission blocks: no growth, no preemption
    s = serve("vllm", flags, time_model=SLOW)
    want = virtual(VllmConfig(num_gpu_blocks=flags["num-gpu-blocks-override"], max_model_len=1024,
                              max_num_seqs=flags.get("max-num-seqs", 256)), n, prompt, out, steps=1)
    assert want[0] < n
    clients = StreamClients(s.url, bodies(n, prompt, out))
    got = wait_for(lambda: (lambda r, w: (r, w) if r + w == n else None)(
        s.value("vllm:num_requests_running"), s.value("vllm:num_requests_waiting")), what="all requests queued")
    assert got == want
    results = clients.join()
    assert all(r["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt + out, "completion_tokens": out,
                              "prompt_tokens_details": None} for r in results)
    assert s.value("vllm:request_success", finished_reason="length") == n
    s.call(s.emu.scheduler.check_pool)


def test_vllm_max_num_active_seqs_caps_running(serve):
    # vLLM 0.31.0 on: v1/core/sched/scheduler.py L127-131 sets max_num_active_reqs from the flag and
    # L892-894 admits no further request at it; the pool (500 blocks) would hold all 12
    n, prompt, out, cap = 12, 100, 12, 3
    s = serve("vllm", {"num-gpu-blocks-override": 500, "max-model-len": 1024, "max-num-active-seqs": cap},
              time_model=SLOW)
    clients = StreamClients(s.url, bodies(n, prompt, out))
    got = wait_for(lambda: (lambda r, w: (r, w) if r + w == n else None)(
        s.value("vllm:num_requests_running"), s.value("vllm:num_requests_waiting")), what="all requests queued")
    assert got == (cap, n - cap)
    scheduler_config = s.emu.dev_server_info()["vllm_config"]["scheduler_config"]  # as 0.33.0 dumps it
    assert scheduler_config["max_num_active_seqs"] == cap
    results = clients.join()
    assert all(r["usage"]["completion_tokens"] == out for r in results)


def test_sglang_running_matches_schedsim(serve):
    n, prompt, out = 16, 100, 200
    s = serve("sglang", {"max-total-tokens": 2500, "context-length": 1024, "enable-metrics": True},
              time_model=TimeModel(step_ms=4.0, prefill_us_per_token=0.0, decode_us_per_seq=0.0))
    cfg = SglangConfig(max_total_num_tokens=2500, context_len=1024,
                       max_running_requests=sglang.resolve_max_running_requests(2500, 1024, None))
    want_running, _ = virtual(cfg, n, prompt, out, steps=1 + sglang.DECODE_LOG_INTERVAL)
    assert 0 < want_running < n
    clients = StreamClients(s.url, bodies(n, prompt, out))
    wait_for(lambda: s.value("sglang:num_running_reqs") == want_running, what=f"{want_running} running")
    assert s.value("sglang:num_queue_reqs") == n - want_running
    results = clients.join()
    assert all(r["usage"]["completion_tokens"] == out for r in results)


def test_vllm_exposition(serve):
    s = serve("vllm", {"num-gpu-blocks-override": 3646, "max-model-len": 8192}, model="m")
    s.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
    fams = s.families()
    kinds = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
             "vllm:num_requests_waiting_by_reason": "gauge", "vllm:kv_cache_usage_perc": "gauge",
             "vllm:num_preemptions": "counter", "vllm:prefix_cache_queries": "counter",
             "vllm:prefix_cache_hits": "counter", "vllm:request_success": "counter",
             "vllm:time_to_first_token_seconds": "histogram", "vllm:cache_config_info": "gauge"}
    for name, kind in kinds.items():
        assert fams[name].type == kind, name
    assert fams["vllm:num_requests_running"].samples[0].labels == {"model_name": "m", "engine": "0"}
    assert {x.labels["finished_reason"] for x in fams["vllm:request_success"].samples
            if x.name.endswith("_total")} == set(vllm.FINISHED_REASONS)
    buckets = [float(x.labels["le"]) for x in fams["vllm:time_to_first_token_seconds"].samples
               if x.name.endswith("_bucket")][:-1]
    assert tuple(buckets) == vllm.TTFT_BUCKETS
    rep = vllm.reported_from_metrics(fams)
    assert (rep.num_blocks, rep.block_size, rep.kv_tokens) == (3646, 16, 58336)
    assert rep.max_concurrency == pytest.approx(7.12109375)
    fixture = FIXTURES / "vllm-0.33.0-metrics.txt"
    real = {f.name: f for f in text_string_to_metric_families(fixture.read_text())}
    assert set(real["vllm:cache_config_info"].samples[0].labels) == set(
        fams["vllm:cache_config_info"].samples[0].labels)
    for name in kinds:
        assert real[name].type == fams[name].type


def test_sglang_exposition(serve):
    s = serve("sglang", {"max-total-tokens": 444500, "context-length": 131072, "enable-metrics": True}, model="m")
    fams = s.families()
    assert not any(x.name.endswith("_created") for f in fams.values() for x in f.samples)
    labels = fams["sglang:num_running_reqs"].samples[0].labels
    assert labels == {"model_name": "m", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
    assert "pid" in fams["sglang:num_retracted_reqs"].samples[0].labels
    assert sglang.reported_from_metrics(fams).kv_tokens == 444500
    fixture = FIXTURES / "sglang-0.5.23-metrics.txt"
    real = {f.name: f for f in text_string_to_metric_families(fixture.read_text())}
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:num_used_tokens",
                 "sglang:max_total_num_tokens", "sglang:new_token_ratio", "sglang:num_retracted_reqs"):
        assert real[name].type == fams[name].type
        assert set(real[name].samples[0].labels) == set(fams[name].samples[0].labels), name
