"""The real sglang-router 0.3.2 in front of emulated vLLM replicas: the facts kvprobe/targets/fleet/router.py
states and the policy behaviour kvprobe/theory/fleet.py models, measured."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvprobe.engines import get_dialect
from kvprobe.load.prompts import ids_to_text
from kvprobe.observe.sampler import scrape_once
from kvprobe.procgroup import group_members
from kvprobe.targets.fleet import router as rt
from kvprobe.targets.fleet.sampler import FleetSampler

from .conftest import MODEL

VLLM = get_dialect("vllm")


def post(url: str, ids: list[int], out: int, *, text: bool = True) -> tuple[int, dict]:
    body = VLLM.completion_body(ids, out, model=MODEL, stream=False)
    if text:
        body["prompt"] = ids_to_text(body["prompt"])
    req = urllib.request.Request(url + VLLM.COMPLETIONS_PATH, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, {"raw": err.read().decode("utf-8", "replace")}


def metric_sum(url: str, name: str) -> float:
    """The sum of a replica's samples of one vLLM metric family, every label set."""
    text, _ = scrape_once(url, VLLM.METRICS)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def finished(url: str) -> float:
    """Requests a replica finished (vllm:request_success_total, all reasons)."""
    return metric_sum(url, VLLM.METRICS.success + "_total")


def prompt(k: int, n: int = 24) -> list[int]:
    return [5000 + 100 * k + i for i in range(n)]


@pytest.mark.slow
def test_router_forwards_text_refuses_ids_and_round_robin_alternates(make_fleet):
    ft = make_fleet(2, "round_robin")
    assert rt.readiness(ft.url) == (True, "2/2 workers healthy")
    status, body = post(ft.url, prompt(0), 3, text=False)
    assert status == 422 and "StringOrArray" in body["raw"]  # token ids refused: PROMPT_FORMAT is text
    status, body = post(ft.url, prompt(1), 5)
    assert status == 200
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (24, 5)  # ignore_eos kept
    for k in range(2, 7):
        assert post(ft.url, prompt(k), 2)[0] == 200
    assert [finished(u) for u in ft.replica_urls] == [3.0, 3.0]  # six requests, one at a time: 3 / 3
    groups = [ft.router.pgid] + [t.pgid for t in ft.replicas]
    ft.stop()
    assert not any(group_members(g) for g in groups)


def running_total(urls: list[str]) -> float:
    """Requests running over the replicas (vllm:num_requests_running)."""
    return sum(metric_sum(url, VLLM.METRICS.running) for url in urls)


def _in_flight(ft, policy_requests: int, out: int = 400) -> dict[str, int]:
    """Sends the requests one after another, each once the one before runs on a replica: the
    router routes concurrent arrivals in parallel, and two that read the tree sizes before either
    is inserted go to the same worker (CI saw 3/4/5) — the claim is about arrivals in turn."""
    threads = [threading.Thread(target=post, args=(ft.url, prompt(10 + k), out)) for k in range(policy_requests)]
    try:
        for k, t in enumerate(threads):
            t.start()
            deadline = time.monotonic() + 10
            while running_total(ft.replica_urls) < k + 1:
                assert time.monotonic() < deadline, f"request {k + 1} never ran"
                time.sleep(0.02)
        deadline = time.monotonic() + 20
        sampler = FleetSampler(ft.replica_urls, VLLM.METRICS, interval=0.05)
        with sampler:
            s = sampler.wait_for(lambda s: s.ok and s.running == policy_requests, timeout=20)
        assert s is not None and time.monotonic() < deadline, "the requests never all ran"
        loads = rt.worker_loads(ft.url)
        running = [int(series.samples[-1].running) for series in sampler.replica_series]
        return {"router": sorted(loads.values()), "running": running}
    finally:
        for t in threads:
            if t.ident is not None:  # started
                t.join(60)


@pytest.mark.slow
def test_cache_aware_with_unique_texts_cycles_and_power_of_two_sees_no_load(make_fleet):
    """theory/fleet.py's two measured claims: cache_aware's smallest-tree rule sends equal-length
    unique texts arriving in turn round the replicas (12 in flight over 3: 4/4/4, the router counting them), and
    power_of_two's router-side load stays 0 with a vLLM backend (so it picks uniformly)."""
    ca = _in_flight(make_fleet(3, "cache_aware"), 12)
    assert ca["router"] == [4, 4, 4] and sorted(ca["running"]) == [4, 4, 4]
    p2 = _in_flight(make_fleet(3, "power_of_two"), 12)
    assert p2["router"] == [0, 0, 0] and sum(p2["running"]) == 12


def test_text_prompts_splice_the_varying_ids_into_their_words():
    """The locustfile's body template with --kv-prompt-format text: P words, the first two carrying
    the request's varying ids (so every prompt stays unique from its first word). In a subprocess:
    importing the locustfile monkey-patches with gevent, never in the pytest process."""
    import subprocess
    import sys

    code = """
import json, sys
from types import SimpleNamespace
from kvprobe.load import locustfile
opts = SimpleNamespace(kv_prompt_tokens=6, kv_output_tokens=4, kv_token_base=1000, kv_token_range=500,
                       kv_shared_prefix_tokens=0, kv_seed=0, kv_engine="vllm", kv_model="m", kv_stream=1,
                       kv_prompt_format="text")
parts = locustfile.body_template(opts)
sys.stdout.write((parts[0] + b"1007" + parts[1] + b"1000" + parts[2]).decode())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    body = json.loads(out.stdout)
    words = body["prompt"].split()
    assert len(words) == 6 and words[:2] == ["t1007", "t1000"]
    assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"] == 4


@pytest.mark.slow
def test_attach_to_a_running_fleet_and_refuse_a_router_not_ready(make_fleet, tmp_path):
    """The attach form (`target: {fleet: {url, replicas: [...]}}`): the router and every replica must
    answer; the facts are the first replica's; the spec names the replicas' URLs."""
    from kvprobe.errors import TargetError
    from kvprobe.spec.expectation import load_expectations
    from kvprobe.targets.fleet.target import FleetTarget

    ft = make_fleet(2, "round_robin")
    attached = FleetTarget.attach(ft.url, ft.replica_urls, engine="vllm", policy="round_robin")
    assert attached.facts().reported.num_blocks == 201 and attached.prompt_format == "text"
    attached.stop()  # attached: stops nothing
    assert ft.alive()
    with pytest.raises(TargetError, match="is not ready|cannot|not answer|refused"):
        FleetTarget.attach(ft.replica_urls[0], ft.replica_urls, engine="vllm", policy="round_robin")
    path = tmp_path / "attach.yaml"
    text = (Path(__file__).resolve().parents[2] / "expectations" / "fleet" / "emulated-vllm-fleet.yaml").read_text()
    path.write_text(text.replace("  fleet: {replicas: 2, router: sglang-router, policy: round_robin}\n"
                                 "  emulator: {seed: 0}\n",
                                 f"  fleet: {{url: {ft.url}, replicas: [{', '.join(ft.replica_urls)}]}}\n"))
    (exp,) = load_expectations(path)
    assert exp.target.mode == "url" and exp.target.url == ft.url
    assert exp.target.fleet == {"replicas": 2, "replica_urls": ft.replica_urls, "router": "sglang-router",
                                "policy": "round_robin"}
