"""The emulator serves gpt-oss-20b as SGLang 0.5.23 does: a full pool of --max-total-tokens and a
window pool beside it (and Qwen3-Next with the radix cache off: a full pool and a state slot per
running request) (theory.sglang_pools, checked against SGLang's own configurator in
tests/shadow_env/test_hybrid_sglang.py), its startup lines and per-pool gauges as the real shadow
logs and serves them (tests/engines/published/sglang-0.5.23-gpt-oss-20b-*), and admission over HTTP
that of schedsim's hybrid sliding-window scheduler (checked against SGLang's own Scheduler in
tests/theory/test_real_sglang.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvprobe.engines import sglang
from kvprobe.errors import ConfigError
from kvprobe.targets.emulator.app import Emulator, Settings
from kvprobe.theory.schedsim import SimRequest, make_scheduler
from kvprobe.theory.sglang.swa.radix import SglangSwaRadixScheduler
from kvprobe.theory.sim.steptime import TimeModel
from tests.emulator.conftest import StreamClients, wait_for

GPT_OSS = "openai/gpt-oss-20b"
FLAGS = {"max-total-tokens": 4000, "context-length": 2048, "disable-radix-cache": True, "enable-metrics": True,
         "decode-log-interval": 10}
STEPS = TimeModel(step_ms=10.0, prefill_us_per_token=0.0, decode_us_per_seq=0.0)
PROMPT, OUTPUT = 600, 50  # full pool: 650 per request (6 fit); window pool: 601 at admission (5 fit)


def _sim(config, n: int, steps: int) -> tuple[int, int]:
    sim = make_scheduler(config)
    for i in range(n):
        sim.add(SimRequest(rid=f"r{i}", prompt=[1000 + i] * PROMPT, max_tokens=OUTPUT))
    first = None
    for _ in range(steps):
        sim.step()
        first = sim.stats.running if first is None else first
    return first, sim.stats.running


def test_the_window_pools_share_is_the_flags():
    emu = Emulator(Settings(engine="sglang", model=GPT_OSS, flags={**FLAGS, "swa-full-tokens-ratio": 0.5}))
    assert emu.config.swa_pool_tokens == 2000


def test_startup_lines_are_sglangs_hybrid_lines():
    emu = Emulator(Settings(engine="sglang", model=GPT_OSS, flags=FLAGS))
    assert (emu.config.sliding_window_size, emu.config.swa_pool_tokens) == (127, 3200)  # ratio 0.8
    text = "\n".join(emu.startup_lines())
    assert sglang.parse_hybrid_startup(text) == {"full_tokens": 4000, "swa_tokens": 3200, "kv_dtype": "torch.bfloat16"}
    assert sglang.parse_startup_log(text).kv_tokens == 4000


def test_the_window_pool_binds_the_first_admission_and_its_gauges_are_sglangs(serve):
    n = 10
    s = serve("sglang", FLAGS, model=GPT_OSS, time_model=STEPS)
    # the window pool admits 5 where the full pool alone would admit 6; once the five have passed
    # their window the pool frees it and the sixth is admitted
    first, steady = _sim(s.emu.config, n, 1 + 10)
    assert (first, steady) == (5, 6)
    assert _sim(replace(s.emu.config, swa_pool_tokens=40000), n, 1)[0] == 6
    clients = StreamClients(s.url, [{"prompt": [1000 + i] * PROMPT, "max_tokens": OUTPUT, "min_tokens": OUTPUT,
                                     "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                                    for i in range(n)])
    wait_for(lambda: s.value("sglang:num_running_reqs") == steady, timeout=20, what=f"{steady} running")
    fams = s.families()
    g = sglang.hybrid_gauges(fams)
    # every figure from the one scrape: the gauges move between two scrapes on a busy machine
    full_used, used = s.value("sglang:kv_used_tokens", fams), s.value("sglang:num_used_tokens", fams)
    assert g["swa_pool_tokens"] == 3200 and s.value("sglang:max_total_num_tokens", fams) == 4000
    assert 0 < g["swa_used_tokens"] < full_used  # out-of-window slots freed
    assert g["swa_usage"] == pytest.approx(g["swa_used_tokens"] / 3200)
    assert g["full_usage"] == pytest.approx(full_used / 4000)
    assert s.value("sglang:token_usage", fams) == round(max(g["full_usage"], g["swa_usage"]), 2)
    assert used == max(full_used, g["swa_used_tokens"]) and g["mamba_usage"] == 0
    results = clients.join()
    assert all(r["usage"]["completion_tokens"] == OUTPUT for r in results)
    s.call(s.emu.scheduler.check_pool)


def test_a_full_model_shows_its_pool_in_the_per_pool_gauges(serve):
    s = serve("sglang", {"max-total-tokens": 2000, "context-length": 1024, "enable-metrics": True})
    s.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
    g = sglang.hybrid_gauges(s.families())
    assert "swa_pool_tokens" not in g and g["swa_usage"] == g["mamba_usage"] == 0


def test_qwen3_next_with_the_radix_cache_off_holds_a_state_slot_per_running_request(serve):
    """expectations/shadow-sglang-qwen3-next.yaml's configuration: the full pool over the 12 full
    layers binds at 5 (4,096 // 801); 8 state slots (--max-running-requests), one per running request."""
    flags = {"max-total-tokens": 4096, "context-length": 2048, "max-running-requests": 8, "disable-radix-cache": True,
             "enable-metrics": True, "decode-log-interval": 10}
    s = serve("sglang", flags, model="Qwen/Qwen3-Next-80B-A3B-Instruct", time_model=STEPS)
    assert (s.emu.pools.mamba_slots, s.emu.max_running, s.emu.config.sliding_window_size) == (8, 8, None)
    n, out = 7, 200
    clients = StreamClients(s.url, [{"prompt": [1000 + i] * PROMPT, "max_tokens": out, "min_tokens": out,
                                     "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                                    for i in range(n)])
    wait_for(lambda: s.value("sglang:num_running_reqs") == 5, timeout=20, what="5 running")
    g = sglang.hybrid_gauges(s.families())
    assert (g["mamba_used_slots"], g["mamba_available_slots"], g["mamba_usage"]) == (5, 3, 5 / 8)
    assert "swa_pool_tokens" not in g and g["swa_usage"] == 0
    assert all(r["usage"]["completion_tokens"] == out for r in clients.join())


def test_models_the_emulator_does_not_split_or_cannot_admit():
    # Gemma 3: SGLang turns hybrid SWA memory off (one full pool), as the emulator does
    emu = Emulator(Settings(engine="sglang", model="google/gemma-3-27b-it", flags=FLAGS))
    assert emu.pools is None and emu.config.sliding_window_size is None
    qwen = "Qwen/Qwen3-Next-80B-A3B-Instruct"
    with pytest.raises(ConfigError, match="recurrent .* the emulator models it with the radix cache off only"):
        Emulator(Settings(engine="sglang", model=qwen, flags={**FLAGS, "disable-radix-cache": False}))
    with pytest.raises(ConfigError, match="needs --max-mamba-cache-size"):  # no slot count without a GPU
        Emulator(Settings(engine="sglang", model=qwen, flags=FLAGS))
    # the radix cache on (SGLang's default): the same pools, admission by the radix-on scheduler
    on = Emulator(Settings(engine="sglang", model=GPT_OSS, flags={**FLAGS, "disable-radix-cache": False}))
    assert isinstance(on.scheduler, SglangSwaRadixScheduler) and on.config.swa_pool_tokens == 3200
