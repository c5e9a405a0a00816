"""The engine's own figure beside the ledger's and the measurement (issue 20): the lines a release
prints about its pool, in the wording real engines printed (GPU logs users posted, recorded 0.33.0
and 0.5.23 output), and the claim an operator reads from them, held against the admission limit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvprobe.engines import get_dialect
from kvprobe.engines.base import ReportedCapacity
from kvprobe.probe.run import ProbeResult
from kvprobe.report.claim import ledger_claim_lines, ledger_figures, probe_figures
from kvprobe.report.console import verdict_table
from kvprobe.spec.expectation import load_expectations
from kvprobe.targets.facts import EngineFacts
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.verdict.checks import CheckResult
from kvprobe.verdict.claim import claim_from_reported, engine_claim, figures
from tests.engine_fixtures import FIXTURES

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "gpu_logs"
PUBLISHED = ROOT / "tests" / "engines" / "published"
H100 = int(79.19 * 2**30)


def _masked(line: str) -> str:
    """A capacity line's words, from the capacity figure on (the log prefix, or what a poster kept of
    it, `# (EngineCore) `, dropped), every number masked."""
    found = re.search(r"(GPU KV cache size:|KV cache size:|Maximum concurrency for).*", line.strip())
    text = found.group(0) if found else re.sub(r"^.*?\] ", "", line.strip())
    return re.sub(r"\d[\d,.]*", "#", text)


def _capacity_lines(text: str) -> list[str]:
    return [_masked(x) for x in text.splitlines() if "KV cache size:" in x or "Maximum concurrency for" in x]


def _logged_vllm_cases():
    for path in sorted(CORPUS.glob("vllm-*.yaml")):
        case = yaml.safe_load(path.read_text())
        if _capacity_lines(case["log"]):
            yield path.stem, case


def _cap(tokens=452_304, blocks=28_269, block=16, max_len=131_072, conc=3.45, running=1024, budget=8192) -> dict:
    return {"num_blocks": blocks, "block_size": block, "kv_tokens": tokens, "max_model_len": max_len,
            "max_concurrency_at_max_model_len": conc, "max_running": running, "token_budget": budget}


@pytest.mark.parametrize("stem,case", list(_logged_vllm_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_vllm_capacity_lines_are_worded_as_the_release_logged_them(stem, case):
    """Every real GPU log of the corpus (0.10.1 to 0.24.0): the same lines, in the same words."""
    logged = _capacity_lines(case["log"])
    ours = [_masked(x) for x in get_dialect("vllm").claim_lines(_cap(), case["version"])
            if "cache_config_info" not in x]
    n = min(len(ours), len(logged))  # a poster's excerpt may stop after the first line
    assert ours[:n] == logged[:n], stem


@pytest.mark.parametrize("fixture", ["vllm-0.33.0-startup.log", "vllm-0.33.0-startup-override.log"])
def test_vllm_033_logs_one_capacity_line(fixture):
    logged = _capacity_lines((FIXTURES / fixture).read_text())
    assert logged and [_masked(x) for x in get_dialect("vllm").claim_lines(_cap(), "0.33.0")[:1]] == logged


def test_the_cache_config_labels_shown_are_the_engines_own():
    """0.33.0 publishes the pool in `vllm:cache_config_info` (a recorded real server's labels)."""
    real = (PUBLISHED / "vllm-0.33.0-cache_config_info.txt").read_text()
    shown = get_dialect("vllm").claim_lines(_cap(), "0.33.0")[-1]
    names = re.findall(r'(\w+)="', shown)
    assert {"num_gpu_blocks", "kv_cache_size_tokens", "kv_cache_max_concurrency"} <= set(names)
    assert all(f'{name}="' in real for name in names)
    older = get_dialect("vllm").claim_lines(_cap(), "0.24.0")[-1]
    assert "kv_cache_size_tokens" not in older and 'num_gpu_blocks="28269"' in older


def test_sglang_capacity_line_reads_back_as_the_engine_wrote_it():
    """The line in 0.5.23's words (recorded real output), and SGLang's own parser reads our figures."""
    line = get_dialect("sglang").claim_lines(_cap(tokens=415_360, running=2048, max_len=8192), "0.5.23")[0]
    real = next(x for x in (PUBLISHED / "sglang-0.5.23-llama-4-scout-startup.log").read_text().splitlines()
                if "max_total_num_tokens=" in x)
    strip = re.compile(r", available_\w+_mem=.*$")
    assert _masked(strip.sub("", line)) == _masked(strip.sub("", real))
    rep = get_dialect("sglang").parse_startup_log("[2026-12-02 10:00:00] " + line.replace("=...", "=1.00 GB"))
    assert (rep.kv_tokens, rep.max_running, rep.max_model_len) == (415_360, 2048, 8192)


def _ledger(engine="vllm", version=None, **kw):
    inp = LedgerInputs(engine=engine, model="meta-llama/Llama-3.1-8B", engine_version=version, gpu_memory_bytes=H100,
                       prompt_tokens=512, output_tokens=256, **kw)
    return build_ledger(inp)


def test_vllm_claim_understates_admission_and_says_why():
    led = _ledger()
    fig = ledger_figures(led)
    assert fig.claim.requests == pytest.approx(led.capacity.kv_tokens / 768)
    assert fig.ledger == pytest.approx(led.admission.limit, abs=0.01)
    assert fig.ledger > 1.1 * fig.claim.requests  # requests grow into their blocks: more run than pool / (P+O)
    assert len(fig.misleads) == 1 and "only at its last step" in fig.misleads[0]
    assert f"{led.capacity.kv_tokens:,} tokens" in ledger_claim_lines(led)[0]


def test_sglang_claim_matches_its_reservation_and_names_a_clamp():
    led = _ledger("sglang")
    fig = ledger_figures(led)
    assert abs(fig.claim.requests - fig.ledger) <= max(1, 0.05 * fig.ledger) and not fig.misleads
    clamped = _ledger("sglang", max_running_requests=10**6)
    fig = ledger_figures(clamped)
    assert clamped.capacity.max_running == clamped.capacity.kv_tokens // 2
    assert any("clamped it to" in m and f"{clamped.capacity.max_running:,}" in m for m in fig.misleads)


def test_a_cap_below_the_pool_is_the_claim():
    claim = engine_claim("vllm", 100_000, 8, 512, 256, "startup log")
    assert claim.requests == 8 and claim.how.startswith("max_num_seqs 8 (below")
    assert not figures(claim, ledger_limit=8, binding="max_num_seqs").misleads


def test_a_hybrid_models_line_is_not_its_admission():
    claim = engine_claim("vllm", 2_893_702, None, 512, 256, "startup log")
    off = figures(claim, ledger_limit=1020, binding="kv", hybrid="full, mamba")
    assert len(off.misleads) == 1 and "sums its KV cache groups" in off.misleads[0]
    near = figures(claim, ledger_limit=claim.requests * 1.01, hybrid="full, mamba")
    assert not near.misleads  # the line misleads only when admission is elsewhere


def test_below_the_claim_names_the_binding_limit():
    claim = engine_claim("sglang", 50_000, None, 512, 256, "metrics")
    fig = figures(claim, ledger_limit=20, binding="token_budget")
    assert "token_budget limit binds" in fig.misleads[0]


def test_measured_is_the_reference_when_there_is_one():
    claim = engine_claim("vllm", 3216, 256, 128, 32, "metrics: vllm:cache_config_info")
    assert not figures(claim, ledger_limit=30, measured=20.4, uncertainty=0.3).misleads
    assert figures(claim, ledger_limit=20.2, measured=30.0).misleads[0].startswith("measured 30.0 is +49%")


def test_a_legacy_engine_reports_blocks_only():
    rep = ReportedCapacity(num_blocks=201, block_size=16, max_running=256, sources={"num_blocks": "startup log"})
    claim = claim_from_reported("vllm", rep, 128, 32)
    assert (claim.tokens, claim.source) == (3216, "startup log")
    assert claim_from_reported("vllm", ReportedCapacity(), 128, 32) is None


def test_a_probe_report_sets_the_three_figures_side_by_side():
    exp = load_expectations(ROOT / "expectations" / "emulated-vllm.yaml")[0]
    led = build_ledger(LedgerInputs(engine="vllm", model=exp.model, num_gpu_blocks_override=201, block_size=16,
                                    max_model_len=2048, prompt_tokens=128, output_tokens=32))
    facts = EngineFacts(engine="vllm", version="0.33.0", url="http://127.0.0.1:1", log_path=None, mode="launch",
                        reported=ReportedCapacity(kv_tokens=3216, max_running=256,
                                                  sources={"kv_tokens": "metrics: vllm:cache_config_info"}))
    check = CheckResult("rejection_point", predicted=20.2, measured=20.6, uncertainty=0.3, passed=True, reason="ok")
    result = ProbeResult(expectation=exp, checks=[check], ledger=led.to_dict(), facts=facts)
    fig = probe_figures(result)
    assert (round(fig.claim.requests, 2), fig.measured) == (20.1, 20.6)
    text = verdict_table(result)
    assert "the engine's figures 20.1" in text and "measured 20.6 ± 0.3" in text
    assert result.to_dict()["figures"]["engine_claim"]["tokens"] == 3216


def test_the_ledger_command_prints_the_engines_lines():
    argv = [sys.executable, "-m", "kvprobe", "ledger", "--engine", "vllm", "--model", "meta-llama/Llama-3.1-8B",
            "--gpu", "H100-80GB", "--prompt-tokens", "512", "--output-tokens", "256"]
    text = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout
    assert "what vllm 0.33.0 will say about its pool:" in text
    assert re.search(r"^  GPU KV cache size: [\d,]+ tokens, Maximum concurrency for 131,072", text, re.M)
    out = json.loads(subprocess.run([*argv, "--json"], capture_output=True, text=True, check=True,
                                    timeout=120).stdout)["engine_figures"]
    assert out["lines"][0].startswith("GPU KV cache size:") and out["misleads"]
