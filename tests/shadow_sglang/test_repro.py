"""A staging run of SGLang reproduced on SGLang 0.5.23's shadow: repro.yaml from a probe attached to
the emulator and from one attached to a shadow server, each replayed on the shadow, agree with what
staging measured within the expectation's rejection-point tolerance (tests/repro_chain.py)."""

from __future__ import annotations

import pytest

from tests.repro_chain import figures as chain_figures
from tests.repro_chain import run_chain, with_levels

from .conftest import shipped, start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # three probes and two shadow starts: 2-4 min here


def test_a_staging_run_reproduces_on_the_sglang_shadow(sglang_env, tmp_path, figures):
    # M = 16,384 tokens, P=512 O=256: SGLang reserves P+O at admission, 21 running; two deep levels (the plateau
    # is read from them alone: a level below the knee weighs nothing in it)
    exp = with_levels(shipped("shadow-sglang-kv"), (28, 31), lifetimes=2.5)
    chain = run_chain(exp, tmp_path, step_ms=8, start_shadow=start_server, stop_shadow=stop_server, log=print)
    figures(chain_figures(chain))
    for repro in (chain.repro_a, chain.repro_b):
        assert repro.target.mode == "shadow" and repro.flags["max-total-tokens"] == 16384
        assert repro.profile.ramp.levels == (28, 31)
    for replay in (chain.shadow, chain.replay):
        assert replay.error is None, replay.error
        assert replay.staging["agrees"] is True, replay.staging["reason"]
    assert chain.replay.repro is None  # a launched replay is no staging run
