"""The staging flow on the real vLLM 0.33.0 (a shadow server started with --max-num-seqs 16), with no
expectation file: `kvprobe probe --url URL --engine vllm` reads what the engine publishes, takes the
cap it does not publish (outside dev mode) under the flag's real name, spends the prediction on the
ramp (`--profile predict`) and passes; the report says where each value came from."""

from __future__ import annotations

import json
import sys

import pytest

from kvprobe.procgroup import free_port
from kvprobe.targets.launch import Target
from tests.cli.console import run
from tests.shadow.test_vllm_e2e import assert_engine_gone


@pytest.mark.slow
def test_a_staging_probe_without_a_file_passes_on_real_vllm(vllm_env, tmp_path, capsys, say, console_tmpdir):
    port = free_port()
    argv = [sys.executable, "-m", "kvprobe", "shadow", "vllm", "meta-llama/Llama-3.1-8B", "--port", str(port),
            "--step-ms", "20", "--num-gpu-blocks-override", "300", "--max-model-len", "2048", "--max-num-seqs", "16",
            "--enforce-eager"]
    art = tmp_path / "art"
    with Target.launch(argv, engine="vllm", port=port, log_path=str(tmp_path / "engine.log"),
                       startup_timeout=300, env=console_tmpdir) as target:
        rc, out, err = run(capsys, "probe", "--url", target.url, "--engine", "vllm", "--prompt-tokens", "128",
                           "--output-tokens", "32", "--max-num-seqs", "16", "--profile", "predict",
                           "--artifacts", str(art))
    assert_engine_gone(tmp_path)
    doc = json.loads((art / "result.json").read_text())
    say(f"staging on real vLLM, no file: {doc['ramp']['lifetimes']} request lifetimes in "
        f"{len(doc['ramp']['levels'])} levels; verdict {doc['verdict']['status']}")
    failed = [c["name"] for c in doc["checks"] if not c["passed"] and not c["inconclusive"]]
    assert rc in (0, 3) or (rc == 1 and failed == ["usage_gap"]), out[-4000:] + err
    if failed:
        # held 1-2 lifetimes on a busy runner, a deep level can run short of max_num_seqs (CI: 14.3 of 16,
        # the gauge 45% against 50%); the gauge must still read the pool of what ran, request for request
        gap = next(c for c in doc["checks"] if c["name"] == "usage_gap")
        deep = [lv for lv in doc["levels"] if lv["waiting_mean"] >= 1]
        assert deep and all(abs(lv["usage_mean"] / lv["running_mean"] * 16 - gap["predicted"]) <= 0.05
                            for lv in deep), out[-4000:]
    # 3 only when a busy runner starved the load generator: every unjudged check says so
    assert rc == 0 or all("load generator was the bottleneck" in c["reason"] for c in doc["checks"]
                          if c["inconclusive"]), out[-4000:]
    assert "kvprobe: assumed (the engine does not publish them): from the command line: max-num-seqs 16" in out
    assert "kvprobe: published by the engine: block-size 16, " in out
    rp = next(c for c in doc["checks"] if c["name"] == "rejection_point")
    assert rp["binding"] == "max_num_seqs" and rp["predicted"] == 16 and abs(rp["measured"] - 16) <= 1, rp
    assert doc["ramp"]["strategy"] == "predict" and doc["discovery"]["declared_by"] == "the command line"
