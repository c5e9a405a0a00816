"""The launcher and the sampler against the real emulator process (`python -m kvprobe emulate ...`)."""

from __future__ import annotations

import importlib.util

import pytest

from kvprobe.observe.sampler import Sampler
from kvprobe.procgroup import free_port, group_members
from kvprobe.targets.launch import Target

from .conftest import gone

pytestmark = pytest.mark.skipif(importlib.util.find_spec("kvprobe.cli.emulate") is None,
                                reason="the emulator (kvprobe.cli.emulate) is not there yet")

CASES = {
    # engine: (flags, what the engine must report about its pool)
    "vllm": ({"num-gpu-blocks-override": 200, "max-model-len": 2048}, {"num_blocks": 200}),
    "sglang": ({"max-total-tokens": 5000, "context-length": 2048}, {"kv_tokens": 5000}),
}


@pytest.mark.slow
@pytest.mark.parametrize("engine", sorted(CASES))
def test_launch_emulator_report_sample_stop(engine, tmp_path):
    from kvprobe.engines import get_dialect

    dialect = get_dialect(engine)
    flags, expected = CASES[engine]
    port = free_port()
    argv = dialect.emulator_command("meta-llama/Llama-3.1-8B", flags, host="127.0.0.1", port=port)
    log = tmp_path / f"{engine}.log"
    with Target.launch(argv, engine=engine, port=port, log_path=str(log), startup_timeout=60) as target:
        facts = target.facts()
        for name, value in expected.items():
            assert getattr(facts.reported, name) == value, (name, facts)
            assert facts.reported.sources.get(name)
        assert facts.reported.max_model_len == 2048
        assert not facts.errors, facts.errors
        sampler = Sampler(target.url, dialect.METRICS, interval=0.05).start()
        try:
            first = sampler.wait_for(lambda s: s.ok, timeout=10)
        finally:
            series = sampler.stop()
        assert first is not None, series.samples[-3:]
        assert (first.running, first.waiting) == (0, 0)
        assert first.usage == 0
        pid, pgid = target.pid, target.pgid
    assert gone(pid) and group_members(pgid) == []
    assert target.stop_report["sigkill"] is False  # the emulator honours SIGTERM


@pytest.mark.slow
def test_sampler_sees_admission_and_drain_on_the_emulator(tmp_path):
    """8 users on a pool of 20 blocks of 16 tokens, P=64 and O=96: KV binds below 8 running."""
    import json
    import threading
    import urllib.request

    from kvprobe.engines import get_dialect

    d = get_dialect("vllm")
    port = free_port()
    argv = d.emulator_command("m", {"num-gpu-blocks-override": 20, "max-model-len": 256}, host="127.0.0.1",
                              port=port, extra=["--step-ms", "10"])
    results = []

    def one(i):
        body = d.completion_body([1000 + i * 100 + k for k in range(64)], 96, model="m", stream=False)
        req = urllib.request.Request(target.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            results.append(json.loads(resp.read())["usage"]["completion_tokens"])

    with Target.launch(argv, engine="vllm", port=port, log_path=str(tmp_path / "e.log"),
                       startup_timeout=60) as target:
        with Sampler(target.url, d.METRICS, interval=0.02) as sampler:
            assert sampler.wait_for(lambda s: s.ok, 10)
            users = [threading.Thread(target=one, args=(i,)) for i in range(8)]
            for u in users:
                u.start()
            busy = sampler.wait_for(lambda s: s.ok and s.waiting >= 1, 20)
            for u in users:
                u.join(60)
            drained = sampler.wait_for(lambda s: s.ok and s.running == 0 and s.waiting == 0 and s.usage == 0, 10)
        series = sampler.series
    assert results == [96] * 8
    assert busy is not None and 1 <= busy.running < 8  # the pool, not the users, bounded admission
    assert busy.waiting_capacity is not None and busy.waiting_capacity >= 1
    assert drained is not None
    arrs = series.arrays()
    assert arrs["ok"].all()
    assert 0 < float(arrs["usage"].max()) <= 1.0
