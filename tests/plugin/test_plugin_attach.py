"""`pytest --kvprobe --kvprobe-url URL`: an attached engine's contradictions with the expectation are
said in the run's output before its ramp."""

from __future__ import annotations

import pytest
import yaml

from kvprobe.engines import vllm
from kvprobe.procgroup import free_port
from kvprobe.targets.launch import Target
from tests.plugin.conftest import REPO

pytestmark = pytest.mark.slow
STAGING_VLLM = {"served-model-name": "staging-llama", "num-gpu-blocks-override": 201, "max-model-len": 2048,
                "max-num-seqs": 16}


@pytest.fixture
def staging(tmp_path):
    """Someone else's vLLM: started with --max-num-seqs 16, its dev-mode /server_info on."""
    port = free_port()
    argv = vllm.emulator_command("meta-llama/Llama-3.1-8B", STAGING_VLLM, host="127.0.0.1", port=port)
    with Target.launch(argv, engine="vllm", port=port, log_path=str(tmp_path / "engine.log"), startup_timeout=60,
                       env={vllm.DEV_MODE_ENV: "1"}) as target:
        yield target


def test_pytest_kvprobe_url_reports_contradictions(kvp, staging):
    engine = staging
    doc = yaml.safe_load((REPO / "expectations" / "emulated-vllm.yaml").read_text())
    doc.update(name="staging", profile="tiny", served_model_name="staging-llama",
               checks=["reported_capacity", "exactness"])  # the contradiction is the point, not timing
    doc["flags"]["max-num-seqs"] = 256
    (kvp.path / "loadprofiles" / "tiny.yaml").write_text(
        "name: tiny\nrequest: {prompt_tokens: 128, output_tokens: 32}\n"
        "ramp: {strategy: explicit, levels: [10, 16, 20]}\n"
        "hold: {seconds: 2.5, warmup: 0.3}\nbudget_seconds: 60\ndrain_seconds: 5\n")
    (kvp.path / "expectations" / "staging.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    result = kvp.runpytest_subprocess("--kvprobe", f"--kvprobe-url={engine.url}", "-s", timeout=300)
    out = result.stdout.str()
    result.assert_outcomes(passed=2)
    said = out.index("CONTRADICTION max-num-seqs: the expectation says 256, the engine publishes 16 (/server_info)")
    assert said < out.index("users   10:")  # before the ramp
