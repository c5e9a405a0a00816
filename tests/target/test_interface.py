"""Every kind of target is one interface to the probe (kvprobe.targets.interface), and one place picks
the kind an expectation names (kvprobe.targets.open)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvprobe.spec.expectation import load_expectations
from kvprobe.targets.fleet.target import FleetTarget
from kvprobe.targets.interface import ProbeTarget
from kvprobe.targets.launch import Target
from kvprobe.targets.open import target_kind
from kvprobe.targets.shadow.target import ShadowTarget

EXPECTATIONS = Path(__file__).resolve().parents[2] / "expectations"
# What a target holds per instance (set when it is opened), not on its class.
INSTANCE_MEMBERS = {"url"}


@pytest.mark.parametrize("cls", [Target, ShadowTarget, FleetTarget])
def test_every_kind_of_target_has_the_whole_interface(cls):
    members = {name for name in ProbeTarget.__dict__ if not name.startswith("_")} | set(
        ProbeTarget.__annotations__)
    missing = [name for name in sorted(members - INSTANCE_MEMBERS) if not hasattr(cls, name)]
    assert not missing, f"{cls.__name__} lacks {missing}"


def _exp(name: str):
    return load_expectations(EXPECTATIONS / name)[0]


def test_the_expectation_names_the_kind_of_target():
    assert target_kind(_exp("emulated-vllm.yaml")) is Target
    assert target_kind(_exp("examples/vllm-h100-llama8b.yaml")) is Target  # launch: engine
    assert target_kind(_exp("shadow-vllm.yaml")) is ShadowTarget
    assert target_kind(_exp("fleet/emulated-vllm-fleet.yaml")) is FleetTarget
    # a URL given by the caller attaches one engine there, whatever the file launches...
    assert target_kind(_exp("shadow-vllm.yaml"), url="http://127.0.0.1:1") is Target
    # ...except a fleet, which attaches as its own spec says
    assert target_kind(_exp("fleet/emulated-vllm-fleet.yaml"), url="http://127.0.0.1:1") is FleetTarget


def test_one_engine_adds_nothing_and_a_fleet_predicts_for_its_replicas():
    exp = _exp("emulated-vllm.yaml")
    sentinel = object()
    assert Target.ledger(exp, sentinel) is sentinel
    assert (Target.pools, Target.one_engine, Target.prompt_format) == (1, True, "ids")
    fleet = _exp("fleet/emulated-vllm-fleet.yaml")
    assert FleetTarget.one_engine is False
    attached = replace(fleet.target, mode="url", url="http://r")
    assert target_kind(replace(fleet, target=attached)) is FleetTarget
