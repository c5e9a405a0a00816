"""First-run frictions in the files a user writes: unknown flags, unknown versions,
profiles found from any folder, and the shipped profiles listed on the console."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from kvprobe.cli.main import main
from kvprobe.errors import ConfigError
from kvprobe.releases import KNOWN_VERSIONS
from kvprobe.spec.expectation import load_expectations
from kvprobe.spec.profile import SHIPPED_PROFILES, shipped_profiles

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, **changes) -> Path:
    doc = {"engine": "vllm", "version": "0.33.0", "model": "meta-llama/Llama-3.1-8B",
           "flags": {"num-gpu-blocks-override": 201, "max-model-len": 2048},
           "target": {"launch": "emulator"}, "profile": "short"}
    doc.update(changes)
    path = tmp_path / "somewhere" / "else" / "exp.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize("target", [{"launch": "emulator"}, {"url": "http://staging:8000"}])
def test_an_unknown_flag_is_an_error_with_the_closest_name(tmp_path, target):
    path = write(tmp_path, target=target, flags={"num-gpu-blocks-override": 201, "max-model-len": 2048,
                                                 "bogus-flag": 3})
    with pytest.raises(ConfigError) as err:
        load_expectations(path)
    assert str(err.value) == (f"{path}: flags.bogus-flag: expected a vllm flag kvprobe knows (`kvprobe ledger "
                              "--help` lists them; only `launch: engine` passes other flags to the engine), "
                              "got 'bogus-flag'")
    path = write(tmp_path, target=target, flags={"num-gpu-block-override": 201})
    with pytest.raises(ConfigError, match=r"flags.num-gpu-block-override: expected a vllm flag "
                                          r"\(did you mean 'num-gpu-blocks-override'\?\)"):
        load_expectations(path)


def test_a_launched_engine_gets_an_unknown_flag_and_judges_it(tmp_path):
    path = write(tmp_path, target={"launch": "engine"}, flags={"max-model-len": 2048, "bogus-flag": 3})
    (exp,) = load_expectations(path)
    assert exp.flags["bogus-flag"] == 3
    from kvprobe.engines import vllm

    argv = vllm.launch_command(exp.model, exp.flags, host="127.0.0.1", port=8000)
    assert argv[-2:] == ["--bogus-flag", "3"]


def test_a_real_flag_kvprobe_does_not_model_is_still_accepted(tmp_path):
    (exp,) = load_expectations(write(tmp_path, flags={"num-gpu-blocks-override": 201, "max-model-len": 2048,
                                                      "enforce-eager": True}))
    assert exp.flags["enforce-eager"] is True


def test_an_unknown_version_lists_the_known_ones_and_the_policy_key(tmp_path):
    path = write(tmp_path, version="9.9.9")
    with pytest.raises(ConfigError) as err:
        load_expectations(path)
    known = ", ".join(KNOWN_VERSIONS["vllm"])
    assert known.startswith("0.9.2, 0.10.0, 0.10.1, 0.10.1.1, 0.10.2, 0.11.0, ") and known.endswith(", 0.33.0, 0.34.0")
    assert str(err.value) == (f"{path}: version: expected a vllm version kvprobe has facts for ({known}), "
                              "or name the admission policy "
                              "with `policy:` (vllm-0.33, vllm-0.11, "
                              "worst-case) to probe '9.9.9' under a rule you chose, got '9.9.9'")
    (exp,) = load_expectations(write(tmp_path, version="9.9.9", policy="vllm-0.33"))
    assert exp.policy == "vllm-0.33"
    from kvprobe.probe.run import predict

    assert predict(exp).admission.policy == "vllm-0.33"
    with pytest.raises(ConfigError, match=r"policy: expected a vllm admission policy, one of vllm-0.33, vllm-0.11, "
                                          r"worst-case"):
        load_expectations(write(tmp_path, version="9.9.9", policy="sglang-0.5.22"))
    sg = write(tmp_path, engine="sglang", version="0.5.99", flags={"max-total-tokens": 3300, "context-length": 2048})
    known = r"\(0.4.1.post7, .*, 0.5.21, 0.5.22, 0.5.23\)"
    with pytest.raises(ConfigError, match=known + r".*\(sglang-0.5.22, sglang-0.5.21, worst-case\)"):
        load_expectations(sg)


def test_shipped_profiles_are_found_by_name_from_any_folder(tmp_path):
    (exp,) = load_expectations(write(tmp_path))  # no loadprofiles/ anywhere near tmp_path
    assert exp.profile.name == "short" and Path(exp.profile.path).parent == SHIPPED_PROFILES
    # a path still works, relative to the expectation
    own = tmp_path / "somewhere" / "mine.yaml"
    own.write_text((SHIPPED_PROFILES / "sweep.yaml").read_text().replace("name: sweep", "name: mine"))
    (exp,) = load_expectations(write(tmp_path, profile="../mine.yaml"))
    assert exp.profile.name == "mine"
    # the user's own loadprofiles/ wins over a shipped profile of the same name
    (tmp_path / "somewhere" / "loadprofiles").mkdir()
    (tmp_path / "somewhere" / "loadprofiles" / "short.yaml").write_text(own.read_text())
    (exp,) = load_expectations(write(tmp_path))
    assert exp.profile.name == "mine"
    with pytest.raises(ConfigError, match=r"did you mean 'short'"):
        load_expectations(write(tmp_path, profile="shrot"))


def test_profiles_are_package_data():
    assert {"short", "long", "bisect", "sweep", "attach"} <= set(shipped_profiles())
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "loadprofiles/*.yaml" in config["tool"]["setuptools"]["package-data"]["kvprobe"]
    assert SHIPPED_PROFILES == ROOT / "kvprobe" / "loadprofiles"


def test_kvprobe_profiles_lists_them(capsys, tmp_path):
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    for name in ("short", "long", "bisect", "sweep", "attach"):
        assert f"\n{name} " in out
    assert "P=128, O=32 streamed; spends the prediction" in out


def test_a_profile_by_name_from_another_folder_in_a_real_process(tmp_path):
    """The first-run report: `profile: short` outside the repository, through the console."""
    path = write(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "kvprobe", "profiles"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 0 and "shipped" in proc.stdout
    code = ("from kvprobe.spec.expectation import load_expectations; "
            f"print(load_expectations({str(path)!r})[0].profile.name)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=60)
    assert proc.stdout.strip() == "short", proc.stderr
