"""The simulation against vLLM 0.33.0's own Scheduler and AsyncScheduler (strongest check).

The same closed loop — arrivals, window, prompts — is run through kvprobe's simulation (its fast
path included) and through vLLM's scheduler classes (tests/theory/real/vllm_driver.py); the means
must agree exactly. The vLLM environment is installed when missing (tests/theory/conftest.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from kvprobe.theory.model.geometry import load_model_config
from kvprobe.theory.schedsim import VllmConfig, arrival_steps, closed_loop, request_lifetime

DRIVER = Path(__file__).with_name("real") / "vllm_driver.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg, _ = load_model_config("meta-llama/Llama-3.1-8B")
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2, "transformers_version": "4.46.0"}))
    return str(d)


def _case(model_dir, cfg: VllmConfig, P, O, users, K, width, lifetimes, warmup):  # noqa: E741
    """kvprobe's closed loop and the driver's spec of the same loop (arrivals, window, prompts)."""
    life = request_lifetime(cfg, P, O)
    arrivals = arrival_steps(life, users, "ramp", width)
    sim = closed_loop(cfg, P, O, users, shared_prefix_tokens=K, ramp_width=width, lifetimes=lifetimes,
                      warmup_lifetimes=warmup, batches=4)
    t0 = arrivals[-1] + math.ceil(warmup * life)
    spec = dict(model_dir=model_dir, blocks=cfg.num_gpu_blocks, block_size=cfg.block_size, P=P, O=O, users=users,
                mml=cfg.max_model_len, K=K, arrivals=arrivals, t0=t0, t_end=t0 + sim.steps,
                max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                caching=cfg.enable_prefix_caching, **{"async": cfg.async_scheduling})
    return sim, spec


def _run_driver(env, specs: list[dict]) -> list[dict]:
    """vLLM's scheduler through every loop, in one process (vLLM's imports cost more than a loop)."""
    out = subprocess.run([str(env.python), str(DRIVER), json.dumps(specs)], capture_output=True, text=True,
                         timeout=900, start_new_session=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


CLOSED = [(False, 0), (True, 0), (True, 256), (False, 200)]  # (async scheduling, shared prefix)
LONG = dict(num_gpu_blocks=1200, max_num_seqs=1024, max_num_batched_tokens=2048, max_model_len=8192)
MORE = [
    # long outputs in a full pool: preempted requests resume on their own cached output blocks
    # (the fast path's runs), recomputing in chunks of the 2,048-token budget
    ("long outputs, async", VllmConfig(**LONG, async_scheduling=True), 300, 3000, 24, 0),
    ("long outputs, sync, shared prefix", VllmConfig(**LONG), 300, 3000, 24, 160),
    ("prefix caching off", VllmConfig(**LONG, enable_prefix_caching=False, async_scheduling=True), 300, 1500, 30, 0),
    ("blocks of 32, max_num_seqs 16", VllmConfig(num_gpu_blocks=500, block_size=32, max_num_seqs=16,
                                                 max_num_batched_tokens=1024, max_model_len=4096), 700, 900, 30, 0),
]


def _closed_cfg(async_scheduling: bool) -> VllmConfig:
    return VllmConfig(num_gpu_blocks=1000, max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=4096,
                      async_scheduling=async_scheduling)


@pytest.fixture(scope="module")
def results(vllm_env, model_dir) -> dict:
    """(simulation, vLLM's figures) of every loop below, vLLM's from one driver run."""
    cases = {("closed", a, k): _case(model_dir, _closed_cfg(a), 512, 256, 40, k, 30, 6, 2) for a, k in CLOSED}
    cases.update({("more", name): _case(model_dir, cfg, P, O, users, K, users, 3, 1)
                  for name, cfg, P, O, users, K in MORE})  # noqa: E741
    real = _run_driver(vllm_env, [spec for _, spec in cases.values()])
    return {key: (sim, r) for (key, (sim, _)), r in zip(cases.items(), real, strict=True)}


@pytest.mark.parametrize("async_scheduling, K", CLOSED)
def test_closed_loop_equals_vllms_scheduler(results, async_scheduling, K):
    sim, real = results[("closed", async_scheduling, K)]
    assert sim.running_mean == pytest.approx(real["running"], abs=1e-9)
    assert sim.waiting_mean == pytest.approx(real["waiting"], abs=1e-9)
    assert sim.usage_mean == pytest.approx(real["usage"], abs=1e-9)
    assert sim.preemptions_per_1k_steps > 0 or K  # the shape preempts: the hard part is exercised


@pytest.mark.parametrize("name, cfg, P, O, users, K", MORE)  # noqa: E741
def test_more_shapes_equal_vllms_scheduler(results, name, cfg, P, O, users, K):  # noqa: E741
    sim, real = results[("more", name)]
    assert (sim.running_mean, sim.waiting_mean) == pytest.approx((real["running"], real["waiting"]), abs=1e-9)
    assert sim.usage_mean == pytest.approx(real["usage"], abs=1e-9)
    assert sim.preemptions_per_1k_steps > 0 or cfg.max_num_seqs < users  # a limit binds: admission is exercised
