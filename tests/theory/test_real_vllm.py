"""The simulation against vLLM 0.33.0's own Scheduler and AsyncScheduler (strongest check).

Skipped unless a vLLM 0.33.0 environment is installed under ~/.cache/kvprobe/envs/ (the shadow
target installs it). The same closed loop — arrivals, window, prompts — is run through kvprobe's
simulation and through vLLM's scheduler classes; the means must agree exactly.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from kvprobe.theory.geometry import load_model_config
from kvprobe.theory.schedsim import VllmConfig, closed_loop, request_lifetime

ENV = Path(os.environ.get("KVPROBE_ENVS", Path.home() / ".cache" / "kvprobe" / "envs")) / "vllm-0.33.0"
PYTHON = ENV / "bin" / "python"
DRIVER = Path(__file__).with_name("real") / "vllm_driver.py"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not PYTHON.exists(), reason=f"no vLLM 0.33.0 environment at {ENV}")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg, _ = load_model_config("meta-llama/Llama-3.1-8B")
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2, "transformers_version": "4.46.0"}))
    return str(d)


def _real(model_dir, cfg: VllmConfig, P, O, users, K, width, lifetimes, warmup):  # noqa: E741
    life = request_lifetime(cfg, P, O)
    spacing = max(1, life // min(users, width))
    arrivals = [u * spacing for u in range(users)]
    sim = closed_loop(cfg, P, O, users, shared_prefix_tokens=K, ramp_width=width, lifetimes=lifetimes,
                      warmup_lifetimes=warmup, batches=4)
    t0 = arrivals[-1] + math.ceil(warmup * life)
    spec = dict(model_dir=model_dir, blocks=cfg.num_gpu_blocks, P=P, O=O, users=users, mml=cfg.max_model_len,
                K=K, arrivals=arrivals, t0=t0, t_end=t0 + sim.steps, **{"async": cfg.async_scheduling})
    out = subprocess.run([str(PYTHON), str(DRIVER), json.dumps(spec)], capture_output=True, text=True, timeout=600,
                         start_new_session=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return sim, json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("async_scheduling, K", [(False, 0), (True, 0), (True, 256), (False, 200)])
def test_closed_loop_equals_vllms_scheduler(model_dir, async_scheduling, K):
    cfg = VllmConfig(num_gpu_blocks=1000, max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=4096,
                     async_scheduling=async_scheduling)
    sim, real = _real(model_dir, cfg, 512, 256, 40, K, 30, 6, 2)
    assert sim.running_mean == pytest.approx(real["running"], abs=1e-9)
    assert sim.waiting_mean == pytest.approx(real["waiting"], abs=1e-9)
    assert sim.usage_mean == pytest.approx(real["usage"], abs=1e-9)
    assert sim.preemptions_per_1k_steps > 0 or K  # the shape preempts: the hard part is exercised
