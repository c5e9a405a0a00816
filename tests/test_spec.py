"""The shipped expectations and profiles load, and the schema means what it says."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from kvprobe.errors import ConfigError
from kvprobe.spec.expectation import (
    CHECKS,
    Expectation,
    ledger_inputs,
    load_expectation_dir,
    load_expectations,
    override_profile,
)
from kvprobe.spec.flags import ledger_kwargs
from kvprobe.spec.profile import load_profile, profile_search_dirs
from kvprobe.spec.schema import FLEET_CHECKS

ROOT = Path(__file__).resolve().parent.parent
EXPECTATIONS = ROOT / "expectations"
PROFILES = ROOT / "kvprobe" / "loadprofiles"  # shipped with the package
SHIPPED_EXPECTATIONS = sorted(EXPECTATIONS.rglob("*.yaml"))
SHIPPED_PROFILES = sorted(PROFILES.glob("*.yaml"))


def test_the_shipped_set_is_there():
    names = {p.relative_to(EXPECTATIONS).as_posix() for p in SHIPPED_EXPECTATIONS}
    assert {"emulated-vllm.yaml", "emulated-sglang.yaml", "examples/vllm-h100-llama8b.yaml",
            "examples/sglang-h100-llama8b.yaml"} <= names
    assert {f"faults/{f}.yaml" for f in ("zombie-blocks", "gauge-written-only", "stuck-admission",
                                         "underreported-pool")} <= names
    assert {p.stem for p in SHIPPED_PROFILES} >= {"short", "long", "bisect", "sweep"}


@pytest.mark.parametrize("path", SHIPPED_PROFILES, ids=lambda p: p.name)
def test_every_shipped_profile_loads(path):
    profile = load_profile(path)
    assert profile.name == path.stem and profile.path == str(path)
    assert profile.request.prompt_tokens > 0 and profile.request.output_tokens > 0


@pytest.mark.parametrize("path", SHIPPED_EXPECTATIONS, ids=lambda p: p.relative_to(EXPECTATIONS).as_posix())
def test_every_shipped_expectation_loads(path):
    found = load_expectations(path)  # one expectation, or `expectations: [...]`
    assert found
    for exp in found:
        assert isinstance(exp, Expectation) and exp.path == str(path)
        assert set(exp.checks) <= set(CHECKS) | (set(FLEET_CHECKS) if exp.target.fleet else set())


def test_shipped_profiles_say_what_the_brief_says():
    short, long_, bisect, sweep = (load_profile(PROFILES / f"{n}.yaml") for n in ("short", "long", "bisect", "sweep"))
    assert (short.request.prompt_tokens, short.request.output_tokens) == (128, 32)
    assert short.ramp.strategy == "predict" and short.hold.seconds == 3
    assert short.sample_interval == pytest.approx(0.1) and short.budget_seconds == 100
    assert (long_.request.prompt_tokens, long_.request.output_tokens) == (2048, 512)
    assert long_.hold.seconds is None and long_.hold.lifetimes >= 1
    # the profiles a user gets without choosing one spend the prediction (docs/probe.md, the predict ramp)
    attach = load_profile(PROFILES / "attach.yaml")
    assert long_.ramp.strategy == attach.ramp.strategy == "predict" and attach.hold.lifetimes == 3
    assert bisect.ramp.strategy == "bisect" and bisect.ramp.confirm >= 1
    assert sweep.ramp.strategy == "explicit" and len(sweep.ramp.levels) == 10


def test_emulated_vllm_expectation():
    (exp,) = load_expectations(EXPECTATIONS / "emulated-vllm.yaml")
    assert (exp.name, exp.engine, exp.version, exp.model) == (
        "emulated-vllm", "vllm", "0.33.0", "meta-llama/Llama-3.1-8B")
    assert exp.flags == {"num-gpu-blocks-override": 201, "block-size": 16, "max-model-len": 2048,
                         "max-num-seqs": 256, "max-num-batched-tokens": 2048}
    assert exp.hardware.gpu_memory_bytes == 24 * 2**30 and exp.hardware.gpu_count == 1
    assert exp.target.mode == "emulator" and exp.profile.name == "short"
    assert exp.checks == ("rejection_point", "reported_capacity", "leak", "usage_gap", "exactness", "length_limit")
    assert exp.expect_fail is None and exp.enabled
    # The numbers in the file's comment: U = 200 usable blocks, 10 blocks per request at peak.
    p, o = exp.profile.request.prompt_tokens, exp.profile.request.output_tokens
    usable = exp.flags["num-gpu-blocks-override"] - 1
    assert usable // -(-(p + o) // exp.flags["block-size"]) == 20


def test_emulated_sglang_expectation():
    (exp,) = load_expectations(EXPECTATIONS / "emulated-sglang.yaml")
    assert exp.engine == "sglang" and exp.version == "0.5.23"
    assert exp.flags["max-total-tokens"] == 3300 and exp.flags["context-length"] == 2048
    total = exp.profile.request.prompt_tokens + exp.profile.request.output_tokens
    assert (exp.flags["max-total-tokens"] - total - 2) // total + 1 == 20


def test_fault_expectations_must_fail_their_check():
    wanted = {"zombie-blocks": "leak", "gauge-written-only": "usage_gap", "stuck-admission": "rejection_point",
              "underreported-pool": "rejection_point"}
    for fault, check in wanted.items():
        (exp,) = load_expectations(EXPECTATIONS / "faults" / f"{fault}.yaml")
        assert exp.target.emulator["faults"] == (fault,)
        assert exp.expect_fail == check and check in exp.checks
        assert exp.profile.name == "short"  # a shipped profile, found by name from any folder


def test_examples_are_valid_but_off_by_default():
    for name in ("vllm-h100-llama8b", "sglang-h100-llama8b"):
        (exp,) = load_expectations(EXPECTATIONS / "examples" / f"{name}.yaml")
        assert exp.enabled is False
        assert exp.target.mode == "launch" and exp.target.startup_timeout == 900
        # `gpu: H100-80GB`: the card's memory as CUDA reports it (kvprobe.spec.gpus), not 80 GiB
        assert exp.hardware.gpu_memory_bytes == 85045477376 and exp.hardware.name == "H100-80GB"


def test_a_directory_is_its_top_level_files_only():
    found = load_expectation_dir([EXPECTATIONS])
    top = {e.name for f in EXPECTATIONS.glob("*.yaml") for e in load_expectations(f)}
    assert {e.name for e in found} == top >= {"emulated-vllm", "emulated-sglang", "shadow-vllm", "shadow-sglang-kv"}
    with_faults = load_expectation_dir([EXPECTATIONS, EXPECTATIONS / "faults"])
    assert len(with_faults) == len(top) + 4 and len({e.name for e in with_faults}) == len(top) + 4
    assert not {e.name for e in found} & {"vllm-h100-llama8b", "zombie-blocks"}  # subfolders run only when named


def test_profile_search_dirs_walk_up_to_loadprofiles():
    assert PROFILES in profile_search_dirs(EXPECTATIONS / "faults" / "zombie-blocks.yaml")


def write(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(obj if isinstance(obj, str) else yaml.safe_dump(obj, sort_keys=False))
    return path


BASE = {
    "engine": "vllm", "version": "0.33.0", "model": "meta-llama/Llama-3.1-8B",
    "flags": {"num-gpu-blocks-override": 201, "max-model-len": "2k"},
    "target": {"launch": "emulator"}, "profile": "short",
}


def test_a_file_can_hold_a_list_and_an_inline_profile(tmp_path):
    inline = {"request": {"prompt_tokens": 100, "output_tokens": 10},
              "ramp": {"strategy": "explicit", "levels": [1, 2]}, "hold": {"lifetimes": 2}}
    path = write(tmp_path / "many.yaml", {"expectations": [
        {**BASE, "name": "a"},
        {**BASE, "name": "b", "profile": inline, "target": {"url": "http://127.0.0.1:9/", "api_key_env": "MY_KEY"}},
    ]})
    a, b = load_expectations(path, profile_dirs=[PROFILES])
    assert a.profile.name == "short" and a.flags["max-model-len"] == 2000  # vLLM: 2k = 2000
    assert b.profile.name == "b-inline" and b.profile.path is None and b.profile.hold.lifetimes == 2
    assert b.target == dataclasses.replace(b.target, mode="url", url="http://127.0.0.1:9", api_key_env="MY_KEY")
    assert a.checks == CHECKS  # every check when none are listed


def test_a_single_file_is_named_after_itself(tmp_path):
    (exp,) = load_expectations(write(tmp_path / "my-probe.yaml", BASE), profile_dirs=[PROFILES])
    assert exp.name == "my-probe" and exp.model_base_dir == str(tmp_path.resolve())


def test_flags_are_normalised_and_unknown_real_flags_pass_to_a_launched_engine(tmp_path):
    flags = {"num-gpu-blocks-override": 201, "device-memory-utilization": 0.9, "max-num-batched-tokens": "4K",
             "enforce-eager": True, "enable-prefix-caching": False, "kv-cache-memory-bytes": "10G",
             "some-new-flag": "x"}
    doc = {**BASE, "flags": flags, "target": {"launch": "engine"}}
    (exp,) = load_expectations(write(tmp_path / "f.yaml", doc), profile_dirs=[PROFILES])
    assert exp.flags["gpu-memory-utilization"] == 0.9 and "device-memory-utilization" not in exp.flags
    assert exp.flags["max-num-batched-tokens"] == 4096 and exp.flags["kv-cache-memory-bytes"] == 10 * 2**30
    assert exp.flags["enforce-eager"] is True and exp.flags["some-new-flag"] == "x"


def test_a_config_json_path_is_relative_to_the_file(tmp_path):
    write(tmp_path / "models" / "tiny" / "config.json", "{}")
    exp_doc = {**BASE, "model": "./models/tiny"}
    (exp,) = load_expectations(write(tmp_path / "x.yaml", exp_doc), profile_dirs=[PROFILES])
    assert exp.model == "./models/tiny"
    assert ledger_kwargs(exp)["model"] == "./models/tiny" and ledger_kwargs(exp)["base_dir"] == str(tmp_path.resolve())


def test_ledger_kwargs_map_the_flags():
    (v,) = load_expectations(EXPECTATIONS / "emulated-vllm.yaml")
    kw = ledger_kwargs(v, users=12)
    assert kw["engine"] == "vllm" and kw["engine_version"] == "0.33.0"
    assert (kw["num_gpu_blocks_override"], kw["block_size"], kw["max_model_len"]) == (201, 16, 2048)
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"]) == (256, 2048)
    assert (kw["prompt_tokens"], kw["output_tokens"], kw["users"]) == (128, 32, 12)
    assert kw["gpu_memory_bytes"] == 24 * 2**30 and ledger_inputs(v).reserve_full_isl is True
    (s,) = load_expectations(EXPECTATIONS / "emulated-sglang.yaml")
    kw = ledger_kwargs(s)
    assert (kw["max_total_tokens"], kw["context_length"], kw["chunked_prefill_size"], kw["page_size"]) == (
        3300, 2048, 2048, 1)
    inputs = ledger_inputs(s)  # flags left out keep LedgerInputs' defaults (the engines' own)
    assert inputs.disable_radix_cache is False and (inputs.tp, inputs.pp, inputs.dp) == (1, 1, 1)


def test_ledger_inputs_build_a_ledger():
    ledger = pytest.importorskip("kvprobe.theory.ledger.build")
    from kvprobe.spec.expectation import ledger_inputs

    (v,) = load_expectations(EXPECTATIONS / "emulated-vllm.yaml")
    inputs = ledger_inputs(v)
    assert isinstance(inputs, ledger.LedgerInputs) and inputs.num_gpu_blocks_override == 201
    cap = ledger.build_ledger(inputs).to_dict()["capacity"]
    assert cap["num_blocks"] == 201 and cap["block_size"] == 16


def test_override_profile_rechecks_lengths(tmp_path):
    (exp,) = load_expectations(EXPECTATIONS / "emulated-vllm.yaml")
    swept = override_profile(exp, "sweep", search_dirs=[PROFILES])
    assert swept.profile.name == "sweep" and swept.name == exp.name
    with pytest.raises(ConfigError,
                       match=r"flags\.max-model-len: expected room for prompt_tokens \+ output_tokens = 2560"):
        override_profile(exp, "long", search_dirs=[PROFILES])


def test_a_missing_profile_name_is_an_error():
    names = r"\(attach, bisect, long, predict, short, sweep\)"
    with pytest.raises(ConfigError, match=r"^nosuch: \(file\): expected a profile name " + names):
        load_profile("nosuch", search_dirs=[PROFILES])
    with pytest.raises(ConfigError, match=r"did you mean 'short'"):
        load_profile("shrot")


def _inline(shared):
    return {"request": {"prompt_tokens": 100, "output_tokens": 10, "shared_prefix_tokens": shared},
            "ramp": {"strategy": "explicit", "levels": [1, 2]}, "hold": {"lifetimes": 2}}


def test_shared_prefix_tokens_reach_the_ledger(tmp_path):
    path = write(tmp_path / "shared.yaml", {**BASE, "name": "s", "profile": _inline(64)})
    (exp,) = load_expectations(path, profile_dirs=[PROFILES])
    assert exp.profile.request.shared_prefix_tokens == 64
    kw = ledger_kwargs(exp)
    assert kw["shared_prefix_tokens"] == 64
    assert kw["async_scheduling"] is True  # vLLM 0.33.0 on a GPU schedules asynchronously by default


@pytest.mark.parametrize("bad", [100, 250, -1, "x"])
def test_shared_prefix_tokens_must_be_shorter_than_the_prompt(tmp_path, bad):
    path = write(tmp_path / "bad.yaml", {**BASE, "name": "s", "profile": _inline(bad)})
    with pytest.raises(ConfigError) as err:
        load_expectations(path, profile_dirs=[PROFILES])
    text = str(err.value)
    assert "bad.yaml" in text and "shared_prefix_tokens" in text and "less than prompt_tokens (100)" in text


def test_async_scheduling_flag_overrides_the_default(tmp_path):
    path = write(tmp_path / "sync.yaml", {**BASE, "name": "s", "flags": {**BASE["flags"], "async-scheduling": False}})
    (exp,) = load_expectations(path, profile_dirs=[PROFILES])
    assert ledger_kwargs(exp)["async_scheduling"] is False
