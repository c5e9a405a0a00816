"""Discovery: the ledger's engine configuration from what an engine publishes, against an expectation
(no server: the engine facts are what a real vLLM 0.33.0 published, tests/engines/published/)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from kvprobe.engines.base import ReportedCapacity
from kvprobe.errors import ConfigError
from kvprobe.observe.discovery import discover, same_value
from kvprobe.probe.run import predict
from kvprobe.releases import KNOWN_VERSIONS
from kvprobe.spec.attach import preset_for
from kvprobe.spec.expectation import load_expectations
from kvprobe.targets.facts import EngineFacts, merge_reports
from tests.engines.test_published import real_vllm_reports

ROOT = Path(__file__).resolve().parents[1]


def facts(reports, url="http://staging:8000") -> EngineFacts:
    reported, conflicts = merge_reports(reports)
    return EngineFacts(engine="vllm", version=reported.version, url=url, reported=reported, log_path=None,
                       mode="attach", conflicts=conflicts)


def staging(tmp_path, **changes):
    doc = {"name": "staging", "engine": "vllm", "version": "0.33.0", "model": "meta-llama/Llama-3.1-8B",
           "served_model_name": "llama", "hardware": {"gpu_memory": "24GiB"},
           "flags": {"max-num-seqs": 256, "max-model-len": 4096, "block-size": 16},
           "target": {"url": "http://staging:8000"}, "profile": "short"}
    doc.update(changes)
    path = tmp_path / "staging.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_expectations(path)[0]


def test_published_flags_win_and_contradictions_name_both_values(tmp_path):
    exp = staging(tmp_path)
    disc = discover(exp, facts(real_vllm_reports()))
    lines = [c.line() for c in disc.contradictions]
    assert lines == [
        "max-num-seqs: the expectation says 256, the engine publishes 16 (/server_info)",
        "served model name: the expectation says llama, the engine publishes staging-llama (/v1/models)",
    ]
    assert disc.flags["max-num-seqs"] == 16 and disc.flags["num-gpu-blocks-override"] == 1000
    assert disc.assumed == []  # dev mode publishes every flag the ledger reads
    ledger = predict(disc.expectation(exp))
    assert ledger.capacity.max_running == 16 and ledger.capacity.num_blocks == 1000
    assert ledger.admission.binding == "max_num_seqs" and ledger.admission.limit == 16
    assert disc.expectation(exp).served_model_name == "staging-llama"
    assert predict(exp).admission.limit == 256  # the file alone: 256 admitted, the confident misdiagnosis


def test_without_dev_mode_unpublished_limits_are_assumptions(tmp_path):
    exp = staging(tmp_path)
    disc = discover(exp, facts(real_vllm_reports()[:3]))  # metrics, /v1/models, /version
    assumed = {a.flag: (a.value, a.origin) for a in disc.assumed}
    assert assumed["max-num-seqs"] == (256, "expectation")
    assert assumed["max-num-batched-tokens"] == (None, "default")
    lines = disc.lines(predict(disc.expectation(exp)))
    text = "\n".join(lines)
    assert "assumed (the engine does not publish them): from the expectation: max-num-seqs 256" in text
    assert "max-num-batched-tokens 2048" in text  # the default the ledger took, with its value
    # the pool flag the expectation did not write is the engine's: num-gpu-blocks-override 1000
    assert "CONTRADICTION served model name" in text and "max-num-seqs" not in [c.key for c in disc.contradictions]
    assert disc.flags["num-gpu-blocks-override"] == 1000


def test_a_flag_the_engine_says_was_not_given(tmp_path):
    exp = staging(tmp_path, flags={"num-gpu-blocks-override": 2000, "kv-cache-memory-bytes": "4GiB"},
                  served_model_name="staging-llama")
    reports = real_vllm_reports()
    no_override = dataclasses.replace(reports[0][1], flags={**reports[0][1].flags, "num-gpu-blocks-override": None})
    disc = discover(exp, facts([("metrics", no_override)]))
    shown = {c.key: c.line() for c in disc.contradictions}
    assert shown["num-gpu-blocks-override"] == ("num-gpu-blocks-override: the expectation says 2000, the engine "
                                                "publishes not given (the engine's default) "
                                                "(metrics: vllm:cache_config_info)")
    assert "kv-cache-memory-bytes" in shown
    assert "num-gpu-blocks-override" not in disc.flags and "kv-cache-memory-bytes" not in disc.flags


def test_no_gpu_memory_and_no_pool_flag_takes_the_engines_pool(tmp_path):
    exp = staging(tmp_path, hardware={}, flags={}, served_model_name="staging-llama")
    rep = real_vllm_reports()[0][1]
    rep = dataclasses.replace(rep, flags={**rep.flags, "num-gpu-blocks-override": None})
    disc = discover(exp, facts([("metrics", rep), real_vllm_reports()[1]]))
    assert disc.flags["num-gpu-blocks-override"] == 1000
    assert disc.pool_from_engine.startswith("1000 (num_gpu_blocks as the engine reports it")
    assert predict(disc.expectation(exp)).capacity.num_blocks == 1000


def test_versions_the_engine_reports(tmp_path):
    exp = staging(tmp_path, served_model_name="staging-llama")
    reports = [*real_vllm_reports()[:2], ("GET /version", ReportedCapacity(version="0.35.0"))]
    known = re.escape(", ".join(KNOWN_VERSIONS["vllm"]))
    with pytest.raises(ConfigError, match=r"reports vllm 0.35.0: expected a vllm version kvprobe has facts for "
                                          rf"\({known}\), or name the admission policy with `policy:`"):
        discover(exp, facts(reports))
    chosen = staging(tmp_path, served_model_name="staging-llama", version="0.33.0", policy="vllm-0.33")
    disc = discover(chosen, facts(reports))
    assert [c.key for c in disc.contradictions] == ["version"]
    assert disc.expectation(chosen).version == "0.35.0"
    # a build label is not another version
    same = discover(exp, facts([("GET /version", ReportedCapacity(version="0.33.0+cu128"))]))
    assert same.contradictions == []


def test_values_resolved_by_the_engine_are_not_contradictions():
    assert same_value("auto", 58320, "max-model-len") and same_value(-1, 4096, "max-model-len")
    assert same_value("auto", "bfloat16", "dtype") and not same_value("fp8", "auto", "kv-cache-dtype")
    assert same_value(0.9, 0.9000000001) and not same_value(True, 1) and not same_value(256, 16)


@pytest.mark.parametrize("names,want", [
    (("meta-llama/Llama-3.1-8B",), "meta-llama/Llama-3.1-8B"),
    (("meta-llama/llama-3.1-8b-instruct",), "meta-llama/Llama-3.1-8B"),
    (("staging-llama", "/models/Qwen3-8B/"), "Qwen/Qwen3-8B"),
    (("Qwen2.5-7B-Instruct",), "Qwen/Qwen2.5-7B"),
    (("staging-llama", "/models/llama-8b"), None),
])
def test_preset_for_a_served_model(names, want):
    found = preset_for(*names)
    assert (found[0] if found else None) == want
