"""A staging run of vLLM reproduced on vLLM 0.33.0's shadow: repro.yaml from a probe attached to the
emulator and from one attached to a shadow server, each replayed on the shadow, agree with what
staging measured within the expectation's rejection-point tolerance (tests/repro_chain.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvprobe.procgroup import free_port
from kvprobe.spec.expectation import load_expectations
from kvprobe.targets.shadow import launch
from kvprobe.targets.shadow.target import ShadowTarget, launch_request
from tests.repro_chain import figures, run_chain, with_levels
from tests.shadow.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # three probes and two shadow starts: 2-4 min here


STAGING_STEP_MS = 10.0  # the emulator's step in staging


def start_shadow(exp, log_path):
    req = launch_request(exp, port=free_port())
    argv, environ = launch.command(req)
    return ShadowTarget.launch(argv, engine=exp.engine, port=req.port, log_path=str(log_path),
                               startup_timeout=300, env=environ)


def stop_shadow(server: ShadowTarget) -> None:
    scratch = Path(server.scratch)
    # vLLM's ZMQ sockets (VLLM_RPC_BASE_PATH, envs.py) live in the target's own TMPDIR, gone with the stop
    assert [p for p in scratch.iterdir() if p.is_socket()], f"no sockets in {scratch}"
    server.stop()
    assert not scratch.exists(), f"{scratch} outlived the server"


def test_a_staging_run_reproduces_on_the_vllm_shadow(vllm_env, tmp_path, say):
    # 1000 blocks of 16, P=512 O=256: vLLM admits on 32 blocks and preempts, plateau ~24.2; two deep levels
    # (the plateau is read from them alone: a level below the knee weighs nothing in it)
    (exp,) = load_expectations(REPO / "expectations" / "shadow-vllm.yaml")
    # staging served with --stream-interval 8 (the emulator streams every token regardless): the replay keeps
    # staging's 10 ms step, where a shadow streaming every token would take twice that for its client to keep up
    exp = with_levels(replace(exp, flags={**exp.flags, "stream-interval": 8}), (33, 38), lifetimes=2.5)
    chain = run_chain(exp, tmp_path, step_ms=STAGING_STEP_MS, start_shadow=start_shadow, stop_shadow=stop_shadow,
                      log=print)
    say(figures(chain))
    for repro in (chain.repro_a, chain.repro_b):
        assert repro.target.mode == "shadow" and repro.flags["num-gpu-blocks-override"] == 1000
        # the replay's step is staging's, read from its measured lifetime (a little over the emulator's own)
        assert repro.flags["stream-interval"] == 8 and repro.target.time_model["step_ms"] < 1.2 * STAGING_STEP_MS
        assert repro.profile.ramp.levels == (33, 38) and repro.staging.preemptions > 0
    for replay in (chain.shadow, chain.replay):
        assert replay.error is None, replay.error
        assert replay.staging["agrees"] is True, replay.staging["reason"]
    assert chain.replay.repro is None  # a launched replay is no staging run
