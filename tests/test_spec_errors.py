"""Broken expectations and profiles: each is one line naming the file, the key path and what was expected.

Every case starts from a valid expectation + profile pair, breaks one thing, and asserts the exact
file, key path and expectation text of the message (and that secrets never appear in it).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kvprobe.errors import ConfigError
from kvprobe.spec.expectation import load_expectation_dir, load_expectations
from kvprobe.spec.profile import load_profile

PROFILE = {
    "name": "short",
    "request": {"prompt_tokens": 128, "output_tokens": 32, "stream": True},
    "ramp": {"strategy": "explicit", "levels": [4, 8, 16, 20, 24]},
    "hold": {"seconds": 3, "warmup": 0.3},
    "sampling": {"interval": 0.1},
    "budget_seconds": 100,
    "drain_seconds": 10,
}

EXPECTATION = {
    "name": "e",
    "engine": "vllm",
    "version": "0.33.0",
    "model": "meta-llama/Llama-3.1-8B",
    "flags": {"num-gpu-blocks-override": 201, "block-size": 16, "max-model-len": 2048},
    "hardware": {"gpu_memory": "24GiB", "count": 1},
    "target": {"launch": "emulator", "emulator": {"seed": 0}},
    "profile": "short",
    "checks": ["rejection_point", "leak"],
}
SGLANG_FLAGS = {"max-total-tokens": 3300, "context-length": 2048}
SECRET = "sk-live-0123456789abcdef"


def put(path: str, value) -> Callable[[dict], None]:
    def apply(d: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        d[last] = value
    return apply


def drop(path: str) -> Callable[[dict], None]:
    def apply(d: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        del d[last]
    return apply


def both(*fns) -> Callable[[dict], None]:
    def apply(d: dict) -> None:
        for fn in fns:
            fn(d)
    return apply


def make_dir_instead(path: Path) -> None:
    path.unlink()
    path.mkdir()


def write_binary(path: Path) -> None:
    path.write_bytes(b"engine: vllm\n\xff\xfe\x00garbage\n")


def duplicate_file(path: Path) -> None:
    (path.parent / "a-first.yaml").write_text(path.read_text())


@dataclass
class Case:
    id: str
    key: str
    expect: str
    exp: Callable | None = None  # mutate the expectation mapping
    profile: Callable | None = None  # mutate the profile mapping
    raw: str | None = None  # the expectation file's text, as is
    where: str = "exp"  # the file the message must name: "exp" | "profile" | "first" (duplicate)
    load: str = "exp"  # "exp" | "profile" | "dir"
    setup: Callable[[Path], None] | None = None  # alters the expectation file after it is written
    absent: str | None = None  # must not appear in the message


CASES = [
    # -- top-level keys and types
    Case("missing-engine", "engine", "expected this key to be present", exp=drop("engine")),
    Case("unknown-engine", "engine", "an engine, one of vllm, sglang (did you mean 'vllm'?)",
         exp=put("engine", "vllmm")),
    Case("engine-wrong-type", "engine", "an engine, one of vllm, sglang", exp=put("engine", ["vllm"])),
    Case("version-number", "version", 'a version string in quotes, e.g. "0.33.0"', exp=put("version", 0.33)),
    Case("unknown-top-key", "engin", "a known key: name", exp=put("engin", "vllm")),
    Case("unknown-top-key-did-you-mean", "flag", "(did you mean 'flags'?)", exp=put("flag", {})),
    Case("bad-name", "name", "a name of letters, digits", exp=put("name", "my probe!")),
    Case("enabled-not-bool", "enabled", "expected true or false", exp=put("enabled", "no way")),
    # -- model
    Case("unknown-preset", "model", "a preset model (", exp=put("model", "meta-llama/Llama-3.1-8X")),
    Case("model-path-missing", "model", "a config.json file or a directory holding one",
         exp=put("model", "./nope/config.json")),
    Case("model-config-missing", "model_config", "a config.json file", exp=put("model_config", "cfg/none.json")),
    # -- flags
    Case("flags-not-mapping", "flags", "a mapping of the engine's flags", exp=put("flags", ["max-model-len=2048"])),
    Case("flag-dashes", "flags.--max-model-len", "the flag name without '--' ('max-model-len')",
         exp=put("flags.--max-model-len", 2048)),
    Case("flag-underscore", "flags.max_num_seqs", "the command-line spelling with '-' ('max-num-seqs')",
         exp=put("flags.max_num_seqs", 8)),
    Case("flag-of-other-engine", "flags.max-total-tokens", "a vllm flag ('max-total-tokens' is a sglang flag)",
         exp=put("flags.max-total-tokens", 3300)),
    Case("flag-typo", "flags.max-num-seq", "a vllm flag (did you mean 'max-num-seqs'?)",
         exp=put("flags.max-num-seq", 8)),
    Case("flag-wrong-type", "flags.max-num-seqs", "expected an integer >= 1", exp=put("flags.max-num-seqs", "lots")),
    Case("flag-bool-for-int", "flags.num-gpu-blocks-override", "expected an integer >= 1",
         exp=put("flags.num-gpu-blocks-override", True)),
    Case("flag-zero", "flags.max-num-seqs", "expected an integer >= 1", exp=put("flags.max-num-seqs", 0)),
    Case("flag-negative-blocks", "flags.num-gpu-blocks-override", "expected an integer >= 1",
         exp=put("flags.num-gpu-blocks-override", -5)),
    Case("flag-fraction-range", "flags.gpu-memory-utilization", "a fraction in (0, 1]",
         exp=put("flags.gpu-memory-utilization", 1.5)),
    Case("flag-bool-type", "flags.enable-prefix-caching", "true or false",
         exp=put("flags.enable-prefix-caching", "off-ish")),
    Case("flag-managed-port", "flags.port", "set target.port instead", exp=put("flags.port", 8000)),
    Case("flag-inline-api-key", "flags.api-key", "secrets never live in YAML", exp=put("flags.api-key", SECRET),
         absent=SECRET),
    Case("flag-null-value", "flags.trust-remote-code", "a value (a number, text, true for a bare flag",
         exp=put("flags.trust-remote-code", None)),
    # -- lengths and hardware
    Case("length-vllm", "flags.max-model-len", "room for prompt_tokens + output_tokens = 160 of profile 'short'",
         exp=put("flags.max-model-len", 128)),
    Case("length-sglang-context", "flags.context-length", "largest P+O here is 157",
         exp=both(put("engine", "sglang"), put("version", "0.5.23"),
                  put("flags", {**SGLANG_FLAGS, "context-length": 159}))),
    Case("length-sglang-pool", "flags.max-total-tokens", "room for prompt_tokens + output_tokens = 160",
         exp=both(put("engine", "sglang"), put("version", "0.5.23"),
                  put("flags", {**SGLANG_FLAGS, "max-total-tokens": 150}))),
    Case("gpu-memory-no-units", "hardware.gpu_memory", "'80' has no unit: write 80GiB (binary) or 80GB (decimal)",
         exp=put("hardware.gpu_memory", 80)),
    Case("gpu-memory-one-letter", "hardware.gpu_memory", "'24G' has a one-letter unit, binary or decimal is not clear",
         exp=put("hardware.gpu_memory", "24G")),
    Case("gpu-memory-garbage", "hardware.gpu_memory", "'80 bananas' has an unknown unit 'bananas': write 80GiB",
         exp=put("hardware.gpu_memory", "80 bananas")),
    Case("gpu-unknown", "hardware.gpu", "unknown GPU 'H900': known GPUs are H100-80GB,",
         exp=put("hardware", {"gpu": "H900"})),
    Case("gpu-and-memory", "hardware.gpu", "one of hardware.gpu or hardware.gpu_memory, not both",
         exp=put("hardware.gpu", "H100-80GB")),
    Case("gpu-free-memory-above-total", "hardware.gpu_free_memory",
         "a free memory at most the card's total 24.00 GiB, got 30 GiB", exp=put("hardware.gpu_free_memory", "30GiB")),
    Case("gpu-free-memory-no-units", "hardware.gpu_free_memory", "'12' has no unit",
         exp=put("hardware.gpu_free_memory", 12)),
    Case("gpu-free-memory-no-total", "hardware.gpu_free_memory", "the card's total too",
         exp=put("hardware", {"gpu_free_memory": "12GiB"})),
    Case("gpu-count-zero", "hardware.count", "a number of GPUs in [1, 4096]", exp=put("hardware.count", 0)),
    Case("tp-beyond-gpus", "hardware.count", "at least 2 GPUs for tp 2 x pp 1 x dp 1",
         exp=put("flags.tensor-parallel-size", 2)),
    Case("hardware-unknown-key", "hardware.memory", "did you mean 'gpu_memory'?", exp=put("hardware.memory", "80GiB")),
    # -- target
    Case("target-missing", "target", "expected this key to be present", exp=drop("target")),
    Case("target-url-and-launch", "target", "either `url` (attach) or `launch` (start), not both",
         exp=put("target", {"url": "http://127.0.0.1:8000", "launch": "engine"})),
    Case("target-neither", "target", "`launch: emulator`, `launch: engine`, `launch: shadow` or `url: http://...`",
         exp=put("target", {"startup_timeout": 10})),
    Case("target-inline-api-key", "target.api_key", "secrets never live in YAML",
         exp=put("target", {"url": "http://127.0.0.1:8000", "api_key": SECRET}), absent=SECRET),
    Case("target-api-key-env-is-a-key", "target.api_key_env", "the NAME of an environment variable",
         exp=put("target", {"url": "http://127.0.0.1:8000", "api_key_env": SECRET}), absent=SECRET),
    Case("target-url-with-credentials", "target.url", "a URL without credentials",
         exp=put("target", {"url": f"https://me:{SECRET}@staging:8000"}), absent=SECRET),
    Case("target-bad-url", "target.url", "an http:// or https:// URL", exp=put("target", {"url": "ftp://host"})),
    Case("target-unknown-launch", "target.launch", "one of emulator, engine", exp=put("target", {"launch": "docker"})),
    Case("target-unknown-fault", "target.emulator.faults[0]", "(did you mean 'zombie-blocks'?)",
         exp=put("target.emulator", {"faults": ["zombie-block"]})),
    Case("target-emulator-step-zero", "target.emulator.step_ms", "milliseconds per step in (0, 10000]",
         exp=put("target.emulator", {"step_ms": 0})),
    Case("target-emulator-needs-pool", "flags.num-gpu-blocks-override", "the emulator has no GPU to size its pool from",
         exp=drop("flags.num-gpu-blocks-override")),
    Case("target-bad-port", "target.port", "a TCP port in [1, 65535]", exp=put("target.port", 70000)),
    Case("target-empty-command", "target.command", "the engine command as a list of arguments",
         exp=put("target", {"launch": "engine", "command": []})),
    # -- profile reference, tolerances, checks
    Case("profile-not-found", "profile", "(did you mean 'short'?)", exp=put("profile", "shortt")),
    Case("profile-path-missing", "profile", "a profile file (looked for", exp=put("profile", "../nope.yaml")),
    Case("profile-inline-bad", "profile.request.prompt_tokens", "a whole number of prompt tokens >= 1",
         exp=put("profile", {**PROFILE, "request": {"prompt_tokens": -1, "output_tokens": 32}})),
    Case("tolerance-out-of-range", "tolerances.reported_capacity", "a relative tolerance in [0, 1)",
         exp=put("tolerances", {"reported_capacity": 1.5})),
    Case("tolerance-negative", "tolerances.rejection_point", "a tolerance in requests in [0, 1e+06]",
         exp=put("tolerances", {"rejection_point": -1})),
    Case("tolerance-usage-gap", "tolerances.usage_gap", "a gauge tolerance (the gauge is 0..1) in [0, 1]",
         exp=put("tolerances", {"usage_gap": 2})),
    Case("tolerance-unknown", "tolerances.rejection", "did you mean 'rejection_point'?",
         exp=put("tolerances", {"rejection": 1})),
    Case("check-unknown", "checks[1]", "a check, one of rejection_point",
         exp=put("checks", ["rejection_point", "leaks"])),
    Case("check-duplicate", "checks", "each check once", exp=put("checks", ["leak", "leak"])),
    Case("checks-empty", "checks", "a list of checks, not empty", exp=put("checks", [])),
    Case("expect-fail-not-a-check", "expect_fail", "one of this expectation's checks: rejection_point, leak",
         exp=put("expect_fail", "usage_gap")),
    # -- the profile file itself
    Case("zero-prompt", "request.prompt_tokens", "a whole number of prompt tokens >= 1",
         profile=put("request.prompt_tokens", 0), where="profile"),
    Case("negative-output", "request.output_tokens", "a whole number of output tokens >= 1",
         profile=put("request.output_tokens", -5), where="profile"),
    Case("prompt-as-text", "request.prompt_tokens", "a whole number of prompt tokens",
         profile=put("request.prompt_tokens", "128"), where="profile"),
    Case("missing-output", "request.output_tokens", "expected this key to be present",
         profile=drop("request.output_tokens"), where="profile"),
    Case("unknown-strategy", "ramp.strategy", "a ramp strategy, one of explicit, around-prediction, bisect",
         profile=put("ramp", {"strategy": "binary"}), where="profile", load="profile"),
    Case("empty-ramp", "ramp.levels", "an empty ramp measures nothing", profile=put("ramp.levels", []),
         where="profile"),
    Case("ramp-level-zero", "ramp.levels[1]", "a user count >= 1", profile=put("ramp.levels", [4, 0]), where="profile"),
    Case("ramp-level-duplicate", "ramp.levels", "distinct user counts", profile=put("ramp.levels", [4, 8, 4]),
         where="profile"),
    Case("ramp-key-of-other-strategy", "ramp.below", "a known key of ramp: strategy, levels",
         profile=put("ramp.below", 2), where="profile"),
    Case("bisect-confirm-zero", "ramp.confirm", "a number of confirming levels >= 1",
         profile=put("ramp", {"strategy": "bisect", "confirm": 0}), where="profile"),
    Case("predict-uncertainty-zero", "ramp.uncertainty", "the rejection point's half-width in requests to hold for > 0",
         profile=put("ramp", {"strategy": "predict", "uncertainty": 0}), where="profile"),
    Case("uncertainty-of-another-strategy", "ramp.uncertainty", "a known key of ramp: strategy, max_users, confirm",
         profile=put("ramp", {"strategy": "bisect", "uncertainty": 0.5}), where="profile"),
    Case("hold-both", "hold", "exactly one of hold.seconds or hold.lifetimes",
         profile=put("hold", {"seconds": 3, "lifetimes": 2}), where="profile"),
    Case("hold-lifetimes-below-one", "hold.lifetimes", "request lifetimes (a level must outlast a request) >= 1",
         profile=put("hold", {"lifetimes": 0.5}), where="profile"),
    Case("hold-too-short-to-sample", "hold.seconds",
         "a hold of at least 0.43 s (3 samples at 0.1 s after 0.3 warm-up), got 0.2",
         profile=put("hold", {"seconds": 0.2}), where="profile", load="profile"),
    Case("hold-shorter-than-request", "profile.hold.seconds", "longer than one request (3.3 s = 33 steps x 100 ms)",
         exp=put("target.emulator", {"step_ms": 100})),
    Case("warmup-out-of-range", "hold.warmup", "a warm-up fraction of the hold in [0, 0.9]",
         profile=put("hold.warmup", 0.95), where="profile"),
    Case("sampling-too-slow", "sampling.interval", "a sampling interval in seconds in [0.005, 1]",
         profile=put("sampling.interval", 5), where="profile"),
    Case("budget-too-small", "budget_seconds", "a budget of at least 25 s (5 levels x 3 s hold + 10 s drain)",
         profile=put("budget_seconds", 20), where="profile"),
    Case("processes-zero", "processes", "a number of Locust processes in [1, 256]",
         profile=put("processes", 0), where="profile"),
    # -- files and YAML
    Case("yaml-syntax", "line 4, column 1", "(while parsing a flow sequence at line 3, column 8)",
         raw="engine: vllm\nversion: '0.33.0'\nmodel: [unclosed\n"),
    Case("yaml-tab-indent", "line 2, column", "expected valid YAML", raw="flags:\n\tmax-model-len: 2048\n"),
    Case("yaml-duplicate-key", "line 2, column 1", "duplicate key 'engine' (first at line 1)",
         raw="engine: vllm\nengine: sglang\n"),
    Case("empty-file", "(top level)", "a mapping of expectation keys, or `expectations: [...]`, got an empty file",
         raw=""),
    Case("top-level-list", "(top level)", "a mapping of expectation keys, or `expectations: [...]`, got a list of 1",
         raw="- engine: vllm\n"),
    Case("list-item-without-name", "expectations[0].name", "a name for each expectation of a list",
         raw=yaml.safe_dump({"expectations": [{k: v for k, v in EXPECTATION.items() if k != "name"}]})),
    Case("list-duplicate-name", "name", "a unique expectation name ('e' is earlier in this file)",
         raw=yaml.safe_dump({"expectations": [EXPECTATION, EXPECTATION]})),
    Case("duplicate-across-files", "name", "a unique expectation name ('e' is also in ", load="dir",
         setup=duplicate_file),
    Case("file-is-a-directory", "(file)", "expected a YAML file, got a directory", setup=make_dir_instead),
    Case("file-missing", "(file)", "expected an existing YAML file, got no such file", setup=lambda p: p.unlink()),
    Case("file-not-utf8", "(file)", "expected UTF-8 text", setup=write_binary),
]


def write_case(tmp_path: Path, case: Case) -> tuple[Path, Path, Path]:
    profiles = tmp_path / "loadprofiles"
    profiles.mkdir()
    profile = copy.deepcopy(PROFILE)
    if case.profile:
        case.profile(profile)
    profile_path = profiles / "short.yaml"
    profile_path.write_text(yaml.safe_dump(profile, sort_keys=False))
    exp_dir = tmp_path / "exp"
    exp_dir.mkdir()
    exp = copy.deepcopy(EXPECTATION)
    if case.exp:
        case.exp(exp)
    exp_path = exp_dir / "e.yaml"
    exp_path.write_text(case.raw if case.raw is not None else yaml.safe_dump(exp, sort_keys=False))
    if case.setup:
        case.setup(exp_path)
    return profiles, profile_path, exp_path


def test_there_are_enough_cases():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_broken_input_is_one_clear_line(tmp_path, case):
    profiles, profile_path, exp_path = write_case(tmp_path, case)
    with pytest.raises(ConfigError) as info:
        if case.load == "profile":
            load_profile(profile_path)
        elif case.load == "dir":
            load_expectation_dir([exp_path.parent], profile_dirs=[profiles])
        else:
            load_expectations(exp_path, profile_dirs=[profiles])
    message = str(info.value)
    assert "\n" not in message, message
    file = {"exp": exp_path, "profile": profile_path}[case.where]
    assert message.startswith(f"{file}: "), message
    assert f": {case.key}" in message, message
    assert case.expect in message, message
    if case.load == "dir":
        assert str(exp_path.parent / "a-first.yaml") in message, message
    if case.absent:
        assert case.absent not in message, message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file(tmp_path):
    path = tmp_path / "locked.yaml"
    path.write_text(yaml.safe_dump(EXPECTATION))
    path.chmod(0)
    try:
        with pytest.raises(ConfigError) as info:
            load_expectations(path)
    finally:
        path.chmod(0o644)
    assert str(info.value) == f"{path}: (file): expected a readable YAML file, got Permission denied"


def test_the_valid_base_case_loads(tmp_path):
    """The table's starting point is valid: every failure above comes from the one thing broken."""
    profiles, _, exp_path = write_case(tmp_path, Case("none", "", ""))
    (exp,) = load_expectations(exp_path, profile_dirs=[profiles])
    assert exp.name == "e" and exp.profile.name == "short"
