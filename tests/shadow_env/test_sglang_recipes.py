"""The SGLang recipes and their pin lists (no install): 0.5.14 to 0.5.22 beside 0.5.23, each pinning
what its own wheel's METADATA pins, and the plugin's hook targets read for each."""

from __future__ import annotations

import pytest

from kvprobe.errors import ConfigError
from kvprobe.releases import KNOWN_VERSIONS
from kvprobe.targets.shadow import envs, recipes
from kvprobe.targets.shadow.sglang import compat, hook_targets
from kvprobe.targets.shadow.sglang import env as sglang_env

# The exact `Requires-Dist: NAME==VERSION` pins (no extras) of the wheels' METADATA that the pin lists
# also hold, copied from `pip download sglang==X --no-deps` (sglang-X.dist-info/METADATA). torch is
# the exception of 0.5.14-0.5.17 (2.11.0) and 0.5.22-0.5.23 (2.14.1, a CUDA build on PyPI): the recipe keeps
# 2.13.0's CPU build.
WHEEL_PINS = {
    "0.5.14": {"apache-tvm-ffi": "0.1.9", "openai": "2.6.1", "soundfile": "0.13.1", "torch": "2.11.0",
               "transformers": "5.8.1", "xgrammar": "0.2.1"},
    **{v: {"apache-tvm-ffi": "0.1.11", "openai": "2.6.1", "soundfile": "0.13.1", "torch": "2.11.0",
           "transformers": "5.12.1", "xgrammar": "0.2.1"} for v in ("0.5.15.post1", "0.5.16", "0.5.17")},
    "0.5.18": {"apache-tvm-ffi": "0.1.11", "openai": "2.6.1", "soundfile": "0.13.1", "torch": "2.13.0",
               "transformers": "5.12.1", "xgrammar": "0.2.1"},
    **{v: {"apache-tvm-ffi": "0.1.11", "compressed-tensors": "0.18.0", "openai": "2.6.1", "soundfile": "0.13.1",
           "tokenizers": "0.22.2", "torch": "2.13.0", "transformers": "5.12.1", "xgrammar": "0.2.1"}
       for v in ("0.5.19", "0.5.20")},
    "0.5.21": {"apache-tvm-ffi": "0.1.11", "compressed-tensors": "0.18.0", "openai": "2.6.1",
               "sentencepiece": "0.2.1", "soundfile": "0.13.1", "tokenizers": "0.22.2", "torch": "2.13.0",
               "transformers": "5.12.1", "xgrammar": "0.2.7"},
    "0.5.22": {"apache-tvm-ffi": "0.1.11", "compressed-tensors": "0.18.0", "openai": "2.6.1",
               "sentencepiece": "0.2.1", "soundfile": "0.13.1", "tokenizers": "0.23.2", "torch": "2.14.1",
               "transformers": "5.19.0", "xgrammar": "0.2.7"},
    "0.5.23": {"apache-tvm-ffi": "0.1.11", "compressed-tensors": "0.18.0", "openai": "2.8.0",
               "sentencepiece": "0.2.1", "soundfile": "0.13.1", "tokenizers": "0.23.2", "torch": "2.14.1",
               "transformers": "5.19.0", "xgrammar": "0.2.7"},
}
CPU_TORCH = "2.13.0"


def _pins(version: str) -> dict[str, str]:
    return envs.pinned(f"sglang-{version}.txt")


@pytest.mark.parametrize("version", sorted(WHEEL_PINS))
def test_pins_follow_the_wheel_metadata(version):
    pins = _pins(version)
    differs = {name: (want, pins.get(name)) for name, want in WHEEL_PINS[version].items()
               if pins.get(name) != want and name != "torch"}
    assert differs == {}, f"sglang-{version}.txt against the {version} wheel's Requires-Dist: {differs}"


def test_0_5_21_pins_differ_from_0_5_23_only_where_the_wheels_do():
    old, new = _pins("0.5.21"), _pins("0.5.23")
    assert old.keys() == new.keys()
    changed = {name for name in old if old[name] != new[name]}
    assert changed == {"sglang", "openai", "tokenizers", "transformers"}


def test_0_5_22_pins_differ_from_0_5_23_only_in_openai():
    """0.5.22's wheel already pins 0.5.23's tokenizers and transformers, and still 0.5.21's openai."""
    old, new = _pins("0.5.22"), _pins("0.5.23")
    assert old.keys() == new.keys()
    assert {name for name in old if old[name] != new[name]} == {"sglang", "openai"}
    assert old["openai"] == _pins("0.5.21")["openai"]


def test_every_recipe_is_a_known_release_whose_hook_targets_were_read():
    """A recipe is only as good as the plugin's hooks in that release: each version with a recipe has its
    hook targets' lines read (hook_targets.py) and is a release kvprobe has facts for."""
    assert set(sglang_env.RECIPES) == set(hook_targets.VERSIONS) == set(WHEEL_PINS)
    assert set(hook_targets.VERSIONS) <= set(KNOWN_VERSIONS["sglang"])
    assert "0.5.22" in recipes.known_versions("sglang")


def test_the_older_releases_pins_differ_from_0_5_21_only_where_their_wheels_do():
    """0.5.15.post1-0.5.20 pin 0.5.21's runtime set but xgrammar 0.2.1; 0.5.14 also transformers 5.8.1 and
    apache-tvm-ffi 0.1.9 (their METADATA; torch stays the CPU build)."""
    base = _pins("0.5.21")
    for version in ("0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20"):
        pins = _pins(version)
        assert pins.keys() == base.keys()
        assert {n for n in pins if pins[n] != base[n]} == {"sglang", "xgrammar"}, version
    pins = _pins("0.5.14")
    assert {n for n in pins if pins[n] != base[n]} == {"sglang", "xgrammar", "transformers", "apache-tvm-ffi"}


@pytest.mark.parametrize(("version", "owner"), [("0.5.14", "ModelRunnerKVCacheMixin"),
                                                 ("0.5.15.post1", "ModelRunnerKVCacheMixin"),
                                                 ("0.5.16", "KVCacheConfigurator"), ("0.5.23", "KVCacheConfigurator")])
def test_the_budget_hook_follows_the_release_that_defines_it(version, owner):
    """Only the budget's owner moved across the releases with a recipe (compat.py): the other five targets
    are 0.5.23's in each."""
    found = hook_targets.targets(compat.release(version))
    assert found["profile_available_bytes"].split(".")[-2] == owner
    assert {k: v for k, v in found.items() if k != "profile_available_bytes"} == \
        {k: v for k, v in hook_targets.TARGETS.items() if k != "profile_available_bytes"}


def test_the_two_releases_build_apart_and_newest_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv(envs.CACHE_ENV, str(tmp_path))
    old, new = envs.env_for("sglang", "0.5.21"), envs.env_for("sglang", "0.5.23")
    assert old.root != new.root and old.root.name.startswith("sglang-0.5.21-")
    assert recipes.recipe("sglang", "0.5.21").digest != recipes.recipe("sglang", "0.5.23").digest
    assert recipes.parse_spec("sglang") == ("sglang", "0.5.23")
    assert {"0.5.21", "0.5.23"} <= set(recipes.known_versions("sglang"))
    # a release with no recipe is refused by name, listing the ones there are
    with pytest.raises(ConfigError, match=r"sglang==0\.5\.14, sglang==0\.5\.15\.post1, .*sglang==0\.5\.23"):
        recipes.recipe("sglang", "0.5.13")


@pytest.mark.parametrize(("version", "environ"), [("0.5.14", {"SGLANG_GRPC_PORT": compat.UNUSED_GRPC_PORT}),
                                                   ("0.5.15.post1", {"SGLANG_GRPC_PORT": compat.UNUSED_GRPC_PORT}),
                                                   ("0.5.16", {}), ("0.5.23", {})])
def test_old_releases_get_a_valid_grpc_port_and_newer_ones_no_grpc_server(version, environ):
    """0.5.14/0.5.15.post1 refuse to start when --port + 10000 > 65535 unless SGLANG_GRPC_PORT is set; from
    0.5.16 that variable would start the native gRPC server, so it is not set there (compat.py)."""
    assert compat.launch_environ(version) == environ
