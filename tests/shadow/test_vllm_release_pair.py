"""Two vLLM releases on their own code: 0.18.1 (the last before 0.19.0's whole-prompt admission)
against 0.33.0, through `kvprobe diff expectations/diff/vllm-full-prompt-shadow.yaml`. The diff must
find 0.18.1's preemptions where requests wait, name the release rule that explains them, and each
release's ledger must predict its own engine (the probes pass). Beside it, what the 0.18.1 environment
adds to run at all: the CPU platform plugin, and the worker's interfaces of that release
(`kvprobe/targets/shadow/vllm/compat.py`). Both environments are installed when missing, never skipped.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvprobe.targets.shadow import envs
from kvprobe.targets.shadow.pythonpath import kvprobe_pythonpath
from kvprobe.theory.vllm.releases import RULES
from tests.cli.console import run
from tests.shadow.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # two installs when missing (~2 min each), two probes

PAIR = str(REPO / "expectations" / "diff" / "vllm-full-prompt-shadow.yaml")
OLD, NEW = "0.18.1", "0.33.0"


def env_python(env: envs.EngineEnv, code: str, **extra: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, **envs.shadow_import_env("vllm"), "PYTHONPATH": str(kvprobe_pythonpath()), **extra}
    return subprocess.run([str(env.python), "-c", code], capture_output=True, text=True, timeout=300, env=environ)


def test_first_chunk_against_whole_prompt_admission_is_found_and_named_on_the_real_engines(
        vllm_release_env, capsys, tmp_path, say):
    vllm_release_env(OLD)
    vllm_release_env(NEW)
    rc, out, err = run(capsys, "diff", PAIR, "--versions", f"{OLD},{NEW}", "--artifacts", str(tmp_path))
    say(out)
    assert rc == 1, out + err[-3000:]  # 1: something changed between the releases
    doc = json.loads((tmp_path / "diff.json").read_text())
    old, new = doc["results"][OLD], doc["results"][NEW]
    assert (old["policy"], new["policy"]) == ("vllm-0.11", "vllm-0.33")
    for release in (old, new):
        assert release["startup"] == "started" and release["pool"] == release["ledger_pool"] == 2000
        # the ledger predicts each release: every check of the probe (rejection point within tolerance) passed
        assert release["status"] == "passed", (release["version"], release["reason"])
    assert old["preemptions_per_deep_level"] > 0 and old["ledger_preemption_rate"] > 0
    assert new["preemptions_per_deep_level"] == 0 and new["ledger_preemption_rate"] == 0
    # one unit on both sides: per 1k engine steps (the ledger's evenly ramped users ~138; the probe's levels,
    # spread over a lifetime, 96-115, and ~20-31 when they started in phase: tests/theory/test_first_chunk_phase.py)
    assert old["preemptions_per_1k_steps"] > 0 and new["preemptions_per_1k_steps"] == 0
    found = {c["quantity"]: c for c in doc["changes"]}
    change = found["preemptions per 1k steps"]
    assert change["explained"], change
    assert change["explanation"] == f"explained: vllm-0.11 -> vllm-0.33, {RULES['vllm-0.33']}"
    assert "startup" not in found and "pool" not in found
    assert f"{OLD} -> {NEW}: preemptions per 1k steps" in out


def test_the_0_18_1_environment_takes_the_cpu_platform_only_when_asked(vllm_release_env):
    env = vllm_release_env(OLD)
    code = "from vllm.platforms import current_platform; print(current_platform.device_type or 'none')"
    asked = env_python(env, code)
    assert asked.returncode == 0 and asked.stdout.split()[-1] == "cpu", asked.stderr[-2000:]
    unasked = env_python(env, code, VLLM_TARGET_DEVICE="cuda")  # 0.33's rule: no other platform is touched
    assert unasked.returncode == 0 and unasked.stdout.split()[-1] != "cpu", unasked.stdout + unasked.stderr[-2000:]


COMPAT = """
import json, torch
from kvprobe.targets.shadow.vllm import compat
from vllm.v1.kv_cache_interface import FullAttentionSpec
spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                         **compat.quant_fields("auto"))
specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(32)}
pool = compat.override_pool_bytes(2000, specs)
blocks = None
if pool:  # what 0.18.1's planner makes of those bytes before the override (kv_cache_utils.get_num_blocks)
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_num_blocks
    blocks = get_num_blocks(VllmConfig(), 32, pool, spec.page_size_bytes)
print(json.dumps({"old": compat.COMPILE_TIMES_FLOAT, "compile": repr(compat.compile_times()),
                  "layouts": compat.default_kv_cache_layouts(), "pool": pool, "blocks": blocks,
                  "refusal": compat.refusal("a DSA indexer")}))
"""


@pytest.mark.parametrize("version", [OLD, NEW])
def test_the_worker_answers_each_release_in_its_own_interface(vllm_release_env, version):
    proc = env_python(vllm_release_env(version), COMPAT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if version == OLD:
        assert got["old"] is True and got["compile"] == "0.0" and got["layouts"] == []
        assert got["blocks"] == 2000  # the override's pool passes 0.18.1's memory check and comes back whole
        assert f"only full-attention (MHA/GQA), window, MLA and Mamba models on vLLM {OLD}" in got["refusal"]
    else:
        assert got["old"] is False and got["compile"].startswith("CompilationTimes(") and got["layouts"]
        assert got["pool"] == 0 and got["refusal"] is None
