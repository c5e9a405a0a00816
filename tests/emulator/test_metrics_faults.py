"""Faults of /metrics itself (metrics-garbage, metrics-drop-after) and vLLM's --disable-log-stats:
what a scraper sees, parsed with prometheus_client's parser; scheduling keeps working under each."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvprobe.engines import get_dialect
from kvprobe.errors import ConfigError
from kvprobe.targets.emulator.faults import FAULTS, parse_faults
from tests.emulator.conftest import wait_for

FLAGS = {"vllm": {"num-gpu-blocks-override": 200, "max-model-len": 1024},
         "sglang": {"max-total-tokens": 4000, "context-length": 1024, "enable-metrics": True}}
BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True}


def scrape(s) -> tuple[int, str]:
    status, _, text = s.request("GET", "/metrics")
    return status, text


def names(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


def served_one(s) -> bool:
    status, text = s.post("/v1/completions", BODY)
    return status == 200 and '"completion_tokens":4' in text


def test_fault_names_are_registered():
    assert {"metrics-garbage", "metrics-drop-after"} <= set(FAULTS)
    assert parse_faults(["metrics-drop-after"]) == {"metrics-drop-after": 3.0}
    assert parse_faults(["metrics-drop-after=0.5", "metrics-garbage"]) == {"metrics-drop-after": 0.5,
                                                                           "metrics-garbage": None}
    for bad in ("metrics-drop-after=-1", "metrics-drop-after=soon"):
        with pytest.raises(ConfigError):
            parse_faults([bad])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_metrics_garbage(serve, engine):
    s = serve(engine, FLAGS[engine], faults=["metrics-garbage"])
    status, text = scrape(s)
    assert status == 200 and text
    with pytest.raises(ValueError):
        names(text)
    assert served_one(s)
    clean = serve(engine, FLAGS[engine])
    assert get_dialect(engine).METRICS.running in names(scrape(clean)[1])  # the same server without it parses


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_metrics_drop_after(serve, engine):
    m = get_dialect(engine).METRICS
    gone = {m.running, m.waiting, m.usage}
    s = serve(engine, FLAGS[engine], faults=["metrics-drop-after=1.0"])
    before = names(scrape(s)[1])
    assert gone <= before
    after = wait_for(lambda: (lambda n: n if not gone & n else None)(names(scrape(s)[1])), timeout=10,
                     what="the running/waiting/usage families to vanish")
    assert before - after >= gone
    kept = before - gone - ({m.waiting_capacity[0]} if m.waiting_capacity else set())
    assert kept <= after  # the rest stays
    assert served_one(s)
    # SGLang's multiprocess collector shows a histogram only once it was observed (as the real one)
    assert m.ttft in names(scrape(s)[1]) and not gone & names(scrape(s)[1])  # for good


def test_vllm_disable_log_stats(serve):
    s = serve("vllm", {**FLAGS["vllm"], "disable-log-stats": True})
    assert served_one(s)
    status, text = scrape(s)
    fams = names(text)
    assert status == 200 and fams, text  # /metrics still mounted, and still Prometheus text
    assert not {f for f in fams if f.startswith("vllm:")}, fams  # no stat logger: no vllm:* family at all
    with_stats = names(scrape(serve("vllm", FLAGS["vllm"]))[1])
    assert {"vllm:num_requests_running", "vllm:cache_config_info"} <= with_stats


def test_disable_log_stats_flag_parses():
    from kvprobe.cli.main import build_parser

    argv = ["emulate", "vllm", "--num-gpu-blocks-override", "10", "--disable-log-stats",
            "--fault", "metrics-drop-after=2", "--api-key", "k"]
    args = build_parser(argv).parse_args(argv)
    assert args.disable_log_stats is True and args.api_key == "k" and args.fault == ["metrics-drop-after=2"]
