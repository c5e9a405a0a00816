"""The emulator serves a hybrid model with vLLM's per-group accounting: the model's KV cache groups
share the one pool (theory.vllm_kv's plan, checked against vLLM's own EngineCore in
tests/shadow_env/test_hybrid_vllm_worker.py), the capacity line and cache_config_info carry the
groups' figures, and admission over HTTP is the hybrid simulation's."""

from __future__ import annotations

import pytest

from kvprobe.engines import vllm
from kvprobe.theory.schedsim import SimRequest, make_scheduler
from kvprobe.theory.sim.steptime import TimeModel
from tests.emulator.conftest import StreamClients, wait_for

# 5 ms steps: the four-running state lasts ~200 steps (1 s), long enough to be seen, short to finish
STEPS = TimeModel(step_ms=5.0, prefill_us_per_token=0.0, decode_us_per_seq=0.0)
GPT_OSS = {"num-gpu-blocks-override": 400, "max-model-len": 4096, "max-num-seqs": 16, "max-num-batched-tokens": 512}


def test_gpt_oss_capacity_is_the_groups(serve):
    """400 blocks / (73 window + 256 full blocks per 4,096-token request) x 4,096 = 4,979 tokens:
    vLLM's own figure for this pool (the shadow worker test), not 400 x 16."""
    s = serve("vllm", GPT_OSS, model="openai/gpt-oss-20b")
    assert [g.kind for g in s.emu.config.groups] == ["sliding", "full"]
    rep = vllm.reported_from_metrics(s.families())
    assert (rep.num_blocks, rep.block_size, rep.kv_tokens) == (400, 16, 4979)
    assert rep.max_concurrency == pytest.approx(400 / (73 + 256))
    assert "GPU KV cache size: 4,979 tokens, Maximum concurrency for 4,096 tokens per request: 1.22x" \
        in s.emu.startup_lines()[-1]


def test_gpt_oss_admission_over_http_is_the_hybrid_simulation(serve):
    """Nine streams of P=1000, O=200: each needs 63 blocks in both groups to be admitted; four run
    (as the real vLLM shadow runs them) and five wait; the usage gauge counts both groups' blocks."""
    n, prompt, out = 9, 1000, 200
    s = serve("vllm", GPT_OSS, model="openai/gpt-oss-20b", time_model=STEPS)
    sim = make_scheduler(s.emu.config)
    for i in range(n):
        sim.add(SimRequest(rid=f"r{i}", prompt=[1000 + i] * prompt, max_tokens=out))
    for _ in range(12):  # two 512-token prefill chunks per prompt; the first output ends at ~step 200
        sim.step()
    want = (sim.stats.running, sim.stats.waiting)
    assert want == (4, 5)
    clients = StreamClients(s.url, [{"prompt": [1000 + i] * prompt, "max_tokens": out, "min_tokens": out,
                                     "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                                    for i in range(n)])
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    wait_for(lambda: tuple(s.value(g) for g in gauges) == want, what=f"{want} running, waiting")
    # The gauge is read once all four decode: the step of a request's last prefill chunk still holds the
    # window blocks its chunks allocated, which the next step's allocate_slots frees (remove_skipped_blocks
    # on the processed tokens: hybrid/kv_cache_manager.py), so (4, 5) begins with up to 342 blocks in use.
    # A stream's second token comes from a step after its last chunk.
    wait_for(lambda: sorted(clients.tokens)[-4] >= 2, what="four streams past their first token")
    scrape = s.families()
    assert tuple(s.value(g, scrape) for g in gauges) == want, "the gauges were read after a request finished"
    # the gauge counts both groups' blocks over the one pool (block_pool.py L921-932): four requests'
    # 63 to 75 full blocks and the <= 9 window blocks each keeps once its prompt passed the window,
    # not the 4 x 126 their admission needed — yet a fifth still needs 126 free blocks to be admitted
    usage = s.value("vllm:kv_cache_usage_perc", scrape)
    assert 4 * (63 + 1) / 399 <= usage <= 4 * (75 + 9) / 399 and 399 * (1 - usage) < 126
    results = clients.join()
    assert all(r["usage"]["completion_tokens"] == out for r in results)
    s.call(s.emu.scheduler.check_pool)


def test_a_hybrid_pool_too_small_is_vllms_refusal(serve):
    from kvprobe.targets.emulator.app import Emulator, Settings

    emu = Emulator(Settings(engine="vllm", model="openai/gpt-oss-20b",
                            flags={**GPT_OSS, "num-gpu-blocks-override": 300}))
    assert emu.refusal is not None and "the estimated maximum model length is 3616" in emu.refusal
