"""The SGLang shadow's pure pieces, in kvprobe's own environment (no engine): the device timeline,
the pseudo tokens, the plugin's switch, the pool's memory check, what the plugin's log lines say."""

from __future__ import annotations

import pytest

from kvprobe.errors import ConfigError, TargetError
from kvprobe.targets.shadow.launch import ShadowLaunch
from kvprobe.targets.shadow.sglang import plugin as sglang_plugin
from kvprobe.targets.shadow.sglang import target as sglang_target
from kvprobe.targets.shadow.sglang.device import DeviceTimeline, pseudo_token_ids, special_ids
from kvprobe.theory.model.geometry import load_model_config

LLAMA = "meta-llama/Llama-3.1-8B"


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 9))
        self.now += seconds


def timeline(overlap: bool, step: float = 0.010):
    clock = FakeClock()
    return DeviceTimeline(lambda p, d: step, overlap=overlap, clock=clock, sleep=clock.sleep), clock


def test_overlap_blocks_the_next_launch_until_the_previous_step_ends():
    dev, clock = timeline(overlap=True)
    dev.run(512, 0)  # batch 1 launched on an idle device: returns at once
    assert clock.slept == [] and dev.busy_until == pytest.approx(100.010)
    clock.now += 0.002  # the scheduler prepares batch 2 while batch 1 runs
    dev.run(0, 1)  # waits for batch 1 (where result(1) would wait on a GPU), batch 2 starts at 100.010
    assert clock.slept == [pytest.approx(0.008)] and dev.busy_until == pytest.approx(100.020)
    clock.now += 0.015  # scheduler slower than the device: no wait, the step starts late
    dev.run(0, 1)
    assert len(clock.slept) == 1 and dev.busy_until == pytest.approx(100.035)


def test_without_overlap_a_forward_returns_when_its_own_step_ends():
    dev, clock = timeline(overlap=False)
    dev.run(512, 0)
    dev.run(0, 1)
    assert clock.slept == [pytest.approx(0.010), pytest.approx(0.010)] and clock.now == pytest.approx(100.020)


def test_step_time_is_the_time_models():
    from kvprobe.theory.sim.steptime import TimeModel

    clock = FakeClock()
    tm = TimeModel(step_ms=5, prefill_us_per_token=1, decode_us_per_seq=20)
    dev = DeviceTimeline(tm.step_seconds, overlap=False, clock=clock, sleep=clock.sleep)
    dev.run(4096, 0)
    dev.run(0, 21)
    assert clock.slept == [pytest.approx(0.005 + 0.004096), pytest.approx(0.005 + 0.00042)]


def test_pseudo_tokens_are_mid_vocabulary_varied_and_never_special():
    special = special_ids(128000, [128001, 128008, 128009], None)
    assert special == {128000, 128001, 128008, 128009}
    ids = pseudo_token_ids(range(600), 128256, special)
    assert len(set(ids)) == 251 and all(0 <= i < 128256 and i not in special for i in ids)
    # a vocabulary whose middle is special: the next ordinary id instead
    tiny = pseudo_token_ids([0, 1], 10, frozenset({5, 6}))
    assert tiny == [7, 7]


def test_the_plugin_does_nothing_without_kvprobe_shadow(monkeypatch):
    monkeypatch.delenv(sglang_plugin.ACTIVE_ENV, raising=False)
    assert sglang_plugin.register() is None  # returns before importing SGLang (not installed here)
    monkeypatch.setenv(sglang_plugin.ACTIVE_ENV, "0")
    assert not sglang_plugin.active()
    monkeypatch.setenv(sglang_plugin.ACTIVE_ENV, "1")
    assert sglang_plugin.active()


def _req(**changes) -> ShadowLaunch:
    config, _ = load_model_config(LLAMA)
    base = dict(engine="sglang", version="0.5.23", model=LLAMA, config=config, served_model_name=LLAMA,
                flags={"max-total-tokens": 16384, "context-length": 2048})
    return ShadowLaunch(**{**base, **changes})


def test_budget_and_memory_of_the_pool_follow_the_ledger():
    bud, per_token = sglang_target.shadow_budget(_req(), _req().flags)
    assert (bud.max_total_num_tokens, per_token, bud.max_running_requests) == (16384, 131072, 4096)
    need = sglang_target.memory_needed(bud, per_token)
    assert need["kv_pool"] == 2 * 2**30  # "K size: 1.00 GB, V size: 1.00 GB" in SGLang's own log
    assert need["req_to_token"] == 4097 * 2048 * 4


def test_a_pool_that_does_not_fit_is_one_clear_error():
    req = _req(flags={"max-total-tokens": 400_000, "context-length": 2048})
    bud, per_token = sglang_target.shadow_budget(req, req.flags)
    with pytest.raises(TargetError, match=r"does not fit in this machine's memory: its KV pool of 400000 "
                                          r"tokens takes 48\.83 GiB .* available\. "
                                          r"Give a smaller flags\.max-total-tokens"):
        sglang_target.check_memory(sglang_target.memory_needed(bud, per_token), bud, available=8 * 2**30)


def test_the_pool_needs_a_size():
    req = _req(flags={"context-length": 2048})
    with pytest.raises(ConfigError, match="needs the pool's size: flags.max-total-tokens, or a declared GPU"):
        sglang_target.shadow_budget(req, req.flags)


def test_one_rank_only():
    req = _req(flags={"max-total-tokens": 16384, "tp-size": 2})
    with pytest.raises(ConfigError, match="runs one rank on a CPU; got tp-size 2"):
        sglang_target.shadow_budget(req, req.flags)


def test_flags_a_cpu_would_default_differently_get_the_ledgers_values():
    req = _req(gpu_memory_bytes=80 * 2**30, flags={"context-length": 8192})
    bud, _ = sglang_target.shadow_budget(req, req.flags)
    flags = sglang_target._shadow_flags(req, req.flags, bud)
    # an 80 GiB card: chunked prefill 8192 and SGLang's reserve formula (a CPU would take 4096 and 0.716)
    assert flags["chunked-prefill-size"] == 8192 and flags["mem-fraction-static"] == bud.fraction < 0.9
    assert flags["device"] == "cpu" and flags["enable-metrics"] is True
    given = _req(gpu_memory_bytes=80 * 2**30, flags={"context-length": 8192, "mem-fraction-static": 0.8})
    bud2, _ = sglang_target.shadow_budget(given, given.flags)
    assert sglang_target._shadow_flags(given, given.flags, bud2)["mem-fraction-static"] == 0.8


def test_a_declared_card_launches_each_release_with_its_own_rules_defaults():
    # SGLang on this CPU cannot see the declared card (memory_hook.py reads the device's memory): the
    # launch flags carry the fraction and chunked prefill of the launched release's rules, as its ledger
    flags = {"context-length": 2048}
    launched = {}
    for version in ("0.5.19", "0.5.20"):
        req = _req(version=version, gpu_memory_bytes=24 * 2**30, flags=flags)
        bud, _ = sglang_target.shadow_budget(req, req.flags)
        launched[version] = sglang_target._shadow_flags(req, req.flags, bud)
    assert (launched["0.5.19"]["mem-fraction-static"], launched["0.5.19"]["chunked-prefill-size"]) == (0.833, 2048)
    assert (launched["0.5.20"]["mem-fraction-static"], launched["0.5.20"]["chunked-prefill-size"]) == (0.704, 4096)


def test_worker_log_is_read_back():
    text = "\n".join([
        "[2026-12-01 10:55:06] kvprobe shadow: plugin active: no weights (meta-llama/Llama-3.1-8B, dtype "
        "torch.bfloat16); time model step_ms=4.0,prefill_us_per_token=1.0,decode_us_per_seq=10.0",
        "[2026-12-01 10:55:06] kvprobe shadow: pool sizing: --max-total-tokens (no declared GPU; unbounded budget)",
        "[2026-12-01 10:55:11] kvprobe shadow: forward: overlap scheduling on",
    ])
    assert sglang_target.parse_worker_log(text) == {
        "plugin": "active", "time_model": "step_ms=4.0,prefill_us_per_token=1.0,decode_us_per_seq=10.0",
        "pool_sizing": "--max-total-tokens (no declared GPU; unbounded budget)", "overlap_scheduling": True}
    assert sglang_target.parse_worker_log("INFO: nothing of ours") == {}
