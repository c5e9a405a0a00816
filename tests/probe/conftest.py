from dataclasses import replace
from pathlib import Path

import pytest

from kvprobe.spec import load_expectations, load_profile

REPO = Path(__file__).resolve().parents[2]

# Levels chosen around the emulated pools' limit of ~20: two below, one at it, two above.
TINY = """
name: tiny
request: {prompt_tokens: 128, output_tokens: 32, stream: true}
ramp: {strategy: explicit, levels: [10, 16, 20, 24, 28]}
hold: {seconds: 2.5, warmup: 0.3}
sampling: {interval: 0.1}
budget_seconds: 60
drain_seconds: 6
"""


@pytest.fixture(scope="session")
def tiny_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profiles") / "tiny.yaml"
    path.write_text(TINY)
    return load_profile(path)


@pytest.fixture
def expectation(tiny_profile):
    """`expectation("emulated-vllm.yaml")` → the shipped expectation with the tiny profile."""

    def get(relpath: str, **changes):
        exp = load_expectations(REPO / "expectations" / relpath)[0]
        return replace(exp, profile=tiny_profile, **changes)

    return get
