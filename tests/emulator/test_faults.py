"""Each fault's effect on the wire and in /metrics, against the same run without it."""

from __future__ import annotations

import pytest

from kvprobe.errors import ConfigError
from kvprobe.targets.emulator.faults import parse_faults
from kvprobe.theory.schedsim import SimRequest, VllmConfig, make_scheduler
from kvprobe.theory.sim.steptime import TimeModel
from tests.emulator.conftest import StreamClients, wait_for

SLOW = TimeModel(step_ms=20.0, prefill_us_per_token=0.0, decode_us_per_seq=0.0)


def streams(n: int, prompt: int, out: int) -> list[dict]:
    return [{"prompt": [1000 + i] * prompt, "max_tokens": out, "min_tokens": out, "ignore_eos": True, "stream": True}
            for i in range(n)]


def test_parse_faults():
    assert parse_faults(["zombie-blocks", "underreported-pool=0.5"]) == {"zombie-blocks": None,
                                                                          "underreported-pool": 0.5}
    with pytest.raises(ConfigError, match="unknown fault"):
        parse_faults(["nope"])
    with pytest.raises(ConfigError, match="factor"):
        parse_faults(["underreported-pool=2"])


@pytest.mark.parametrize("fault", [[], ["zombie-blocks"]])
def test_zombie_blocks_never_drain(serve, fault):
    s = serve("vllm", {"num-gpu-blocks-override": 200, "max-model-len": 4096}, faults=fault)
    clients = StreamClients(s.url, streams(5, 100, 3000))
    wait_for(lambda: s.value("vllm:num_requests_running") == 5, what="5 running")
    clients.cancel()
    wait_for(lambda: s.value("vllm:num_requests_running") == 0, what="aborted")
    usage = s.value("vllm:kv_cache_usage_perc")
    if fault:
        assert usage * 199 >= 5 * 7 - 1e-6, "the aborted requests' blocks stay in use"
        with pytest.raises(AssertionError, match="leak"):
            s.call(s.emu.scheduler.check_pool)
    else:
        assert usage == 0.0


def test_gauge_written_only_reads_low(serve):
    s = serve("vllm", {"num-gpu-blocks-override": 400, "max-model-len": 4096}, faults=["gauge-written-only=0.1"],
              time_model=TimeModel(step_ms=2.0, prefill_us_per_token=0.0, decode_us_per_seq=0.0))
    clients = StreamClients(s.url, streams(5, 100, 3000))
    # decode grows the real pool use; the faulty gauge keeps counting 6 full prompt blocks per request
    def gap():
        fams = s.families()
        real, shown = (fams[n].samples[0].value for n in ("kvprobe_emulator_pool_usage", "vllm:kv_cache_usage_perc"))
        return shown > 0 and real - shown > 0.1
    wait_for(gap, what="gauge refreshed and below the real usage")
    assert s.value("vllm:kv_cache_usage_perc") == pytest.approx(5 * 96 / (399 * 16), abs=1e-9)
    clients.cancel()


def test_stuck_admission_never_recovers(serve):
    n, prompt, out = 20, 100, 12
    s = serve("vllm", {"num-gpu-blocks-override": 65, "max-model-len": 1024}, faults=["stuck-admission"],
              time_model=SLOW)
    clients = StreamClients(s.url, streams(n, prompt, out))
    wait_for(lambda: s.value("vllm:num_requests_running") == 0 and s.value("vllm:num_requests_waiting") == 11,
             timeout=15, what="running drained while 11 wait")
    # the server finished them; their client threads record the end a moment later
    wait_for(lambda: sum(1 for r in clients.results if r is not None) == 9, timeout=10,
             what="the first 9 served, and only them")
    assert sum(1 for r in clients.results if r is not None) == 9, "only the first 9 were ever served"
    assert s.value("vllm:kv_cache_usage_perc") == 0.0, "the pool is empty, yet nothing is admitted"
    clients.cancel()
    wait_for(lambda: s.value("vllm:num_requests_waiting") == 0, what="disconnects leave the queue")


def test_underreported_pool(serve):
    n, prompt, out = 20, 100, 12
    s = serve("vllm", {"num-gpu-blocks-override": 100, "max-model-len": 1024},
              faults=["underreported-pool=0.75"], time_model=SLOW)
    fams = s.families()
    assert fams["vllm:cache_config_info"].samples[0].labels["num_gpu_blocks"] == "100"

    def admitted(blocks):
        sched = make_scheduler(VllmConfig(num_gpu_blocks=blocks, max_model_len=1024))
        for i in range(n):
            sched.add(SimRequest(rid=str(i), prompt=[1000 + i] * prompt, max_tokens=out))
        sched.step()
        return sched.stats.running

    assert admitted(75) < admitted(100)
    clients = StreamClients(s.url, streams(n, prompt, out))
    wait_for(lambda: s.value("vllm:num_requests_running") + s.value("vllm:num_requests_waiting") == n,
             what="all queued")
    assert s.value("vllm:num_requests_running") == admitted(75)
    clients.join()
