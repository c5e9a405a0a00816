"""`kvprobe probe --url URL --engine E` with the engine's flags under their real names, for what the
engine does not publish: vLLM outside dev mode does not publish --max-num-seqs, so a staging engine
capped at 4 fails the probe until the command line says so. The report says which values came from
the engine and which from the command line; a declared value the engine contradicts loses, and the
contradiction is printed. Against kvprobe's vLLM emulator in its own process (someone else's engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvprobe.engines import get_dialect
from kvprobe.procgroup import free_port
from kvprobe.targets.launch import Target
from tests.cli.console import run

CAPPED = {"num-gpu-blocks-override": 200, "max-model-len": 1024, "max-num-seqs": 4}


@pytest.fixture
def capped(tmp_path):
    """A vLLM emulator started with --max-num-seqs 4, not in dev mode: the cap is not published."""
    port = free_port()
    argv = get_dialect("vllm").emulator_command("meta-llama/Llama-3.1-8B", CAPPED, host="127.0.0.1", port=port)
    target = Target.launch(argv, engine="vllm", port=port, log_path=str(tmp_path / "engine.log"), startup_timeout=60)
    yield target
    target.stop()


def _probe(capsys, url: str, art: Path, *flags: str) -> tuple[int, str, dict]:
    rc, out, err = run(capsys, "probe", "--url", url, "--engine", "vllm", "--prompt-tokens", "128",
                       "--output-tokens", "32", "--profile", "short", "--artifacts", str(art), *flags)
    assert rc in (0, 1, 3), out[-3000:] + err  # 3: a busy runner starved the load generator (judged below)
    return rc, out, json.loads((art / "result.json").read_text())


def _client_bound(check: dict) -> bool:
    return check["inconclusive"] and "load generator was the bottleneck" in check["reason"]


@pytest.mark.slow
def test_a_declared_cap_the_engine_does_not_publish(capsys, capped, tmp_path):
    rc, out, doc = _probe(capsys, capped.url, tmp_path / "bare")
    rp = next(c for c in doc["checks"] if c["name"] == "rejection_point")
    # the ledger assumed vLLM's default of 256 sequences: the pool binds at 19, the engine runs 4
    assert (rc == 1 and not rp["passed"] and not rp["inconclusive"]) or _client_bound(rp), out[-3000:]
    assert rp["binding"] != "max_num_seqs"

    rc, out, doc = _probe(capsys, capped.url, tmp_path / "declared", "--max-num-seqs", "4", "--block-size", "32")
    said = [line for line in out.splitlines() if line.startswith("kvprobe: ") and (
        "published by the engine" in line or "assumed" in line or "CONTRADICTION" in line)]
    assert said[0].startswith("kvprobe: published by the engine: block-size 16, ") and "max-num-seqs" not in said[0]
    assert said[1].startswith("kvprobe: assumed (the engine does not publish them): from the command line: "
                              "max-num-seqs 4; the engine's defaults: ")
    assert said[2:] == ["kvprobe: CONTRADICTION block-size: the command line says 32, the engine publishes 16 "
                        "(metrics: vllm:cache_config_info); the engine's value is used"]
    assert out.index("binding limit: max_num_seqs") < out.index("kvprobe: published by the engine")
    rp = next(c for c in doc["checks"] if c["name"] == "rejection_point")
    assert rp["binding"] == "max_num_seqs" and rp["predicted"] == 4
    assert rc == 0 or (rc in (1, 3) and _client_bound(rp)), out[-3000:]
    assert [c["key"] for c in doc["discovery"]["contradictions"]] == ["block-size"]
    assert doc["discovery"]["declared_by"] == "the command line"
    assert doc["prediction"]["capacity"]["block_size"] == 16


def test_a_flag_of_the_other_engine_is_bad_input(capsys):
    rc, out, err = run(capsys, "probe", "--url", "http://127.0.0.1:9", "--engine", "vllm", "--prompt-tokens", "8",
                       "--output-tokens", "8", "--max-running-requests", "16")
    assert rc == 2 and out == ""
    assert err.splitlines() == ["kvprobe probe: error: --max-running-requests: expected a vllm flag "
                                "(--max-running-requests is a sglang flag; `kvprobe probe --help` lists both)"]


def test_declared_flags_beside_an_expectation_file_are_refused(capsys):
    rc, _, err = run(capsys, "probe", "expectations/emulated-vllm.yaml", "--max-num-seqs", "16")
    assert rc == 2
    assert err.splitlines()[0] == ("kvprobe probe: error: expected these options only without an expectation file "
                                   "(the file says them): --max-num-seqs")


def test_the_help_lists_the_engine_flags(capsys):
    rc, out, _ = run(capsys, "probe", "--help")
    assert rc == 0 and "--max-num-seqs" in out and "--max-running-requests" in out
