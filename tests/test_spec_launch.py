"""Launch options of an expectation's target: `launch: shadow`, `env`, `command` paths, `model`, and
the console's `--engine-command` — each mistake one line naming the file and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvprobe.errors import ConfigError
from kvprobe.spec.expectation import load_expectations
from kvprobe.spec.launch import split_command

PROFILE = {"request": {"prompt_tokens": 128, "output_tokens": 32},
           "ramp": {"strategy": "explicit", "levels": [4]}, "hold": {"seconds": 1}}


def write(tmp_path: Path, target: dict, **keys) -> Path:
    doc = {"name": "e", "engine": "vllm", "version": "0.33.0", "model": "meta-llama/Llama-3.1-8B",
           "flags": {"num-gpu-blocks-override": 500}, "target": target, "profile": PROFILE, **keys}
    path = tmp_path / "exp" / "e.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def load(tmp_path, target, **keys):
    return load_expectations(write(tmp_path, target, **keys))[0]


def refused(tmp_path, target, **keys) -> str:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, target, **keys)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(tmp_path / "exp" / "e.yaml")), message
    return message


def test_shadow_target_with_its_time_model_and_env(tmp_path):
    exp = load(tmp_path, {"launch": "shadow", "time_model": {"step_ms": 4, "decode_us_per_seq": 3},
                          "env": {"OMP_NUM_THREADS": 1, "VLLM_LOGGING_LEVEL": "DEBUG", "FLAG": True}})
    t = exp.target
    assert t.mode == "shadow" and t.startup_timeout == 300
    assert t.time_model == {"step_ms": 4.0, "decode_us_per_seq": 3.0}
    assert t.env == {"OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "DEBUG", "FLAG": "1"}


def test_shadow_refuses_a_free_memory_at_start(tmp_path):
    """The shadow worker sizes from one declared GPU figure, as an empty card: a shared card's free memory
    (hardware.gpu_free_memory, the ledger's SGLang input) would size it differently from the ledger."""
    message = refused(tmp_path, {"launch": "shadow"},
                      hardware={"gpu_memory": "80GiB", "gpu_free_memory": "40GiB", "count": 1})
    assert "hardware.gpu_free_memory: " in message and "launch: shadow" in message, message


def test_shadow_is_valid_for_sglang_too(tmp_path, monkeypatch):
    from kvprobe.targets.shadow import envs

    if ("sglang", "0.5.23") not in envs.RECIPES:  # registered by the SGLang shadow's own module
        monkeypatch.setitem(envs.RECIPES, ("sglang", "0.5.23"), envs.Recipe("sglang", "0.5.23", (), "sglang"))
    with pytest.raises(ConfigError, match=r"hardware\.gpu_memory: .*flags\.max-total-tokens"):
        load(tmp_path, {"launch": "shadow"}, engine="sglang", version="0.5.23", flags={})
    exp = load(tmp_path, {"launch": "shadow"}, engine="sglang", version="0.5.23",
               flags={"max-total-tokens": 20000})
    assert exp.target.mode == "shadow" and exp.engine == "sglang"


def test_shadow_engine_args_reach_the_launch_and_not_the_theory(tmp_path):
    from kvprobe.probe.run import predict
    from kvprobe.targets.shadow.target import launch_request

    exp = load(tmp_path, {"launch": "shadow", "engine_args": ["--no-scheduler-reserve-full-isl"]},
               flags={"num-gpu-blocks-override": 500, "max-model-len": 4096})
    assert exp.target.engine_args == ("--no-scheduler-reserve-full-isl",)
    assert launch_request(exp, port=8000).engine_args == ("--no-scheduler-reserve-full-isl",)
    assert "scheduler-reserve-full-isl" not in exp.flags and predict(exp).admission.policy == "vllm-0.33"


@pytest.mark.parametrize(("target", "keys", "key", "expect"), [
    ({"launch": "shadow", "engine_args": "--x"}, {}, "target.engine_args", "a list"),
    ({"launch": "shadow", "engine_args": [1]}, {}, "target.engine_args[0]", "a command-line argument"),
    ({"launch": "emulator", "engine_args": ["--x"]}, {}, "target.engine_args", "unknown key 'engine_args'"),
    ({"launch": "shadow", "command": "x"}, {}, "target.command", "unknown key 'command'"),
    ({"launch": "shadow", "time_model": {"step_ms": 0}}, {}, "target.time_model.step_ms", "milliseconds per step"),
    ({"launch": "shadow", "time_model": {"steps": 1}}, {}, "target.time_model.steps", "did you mean 'step_ms'"),
    ({"launch": "shadow"}, {"flags": {}}, "hardware.gpu_memory",
     "a declared GPU (hardware.gpu NAME or hardware.gpu_memory SIZE) with target launch: shadow, or one of "
     "flags.num-gpu-blocks-override"),
    ({"launch": "shadow"}, {"version": "0.11.0"}, "version", "no pinned install list for vllm 0.11.0"),
    ({"launch": "engine", "env": {"HF_TOKEN": "hf_abc"}}, {}, "target.env.HF_TOKEN", "value not shown"),
    ({"launch": "shadow", "env": {"PYTHONPATH": "/x"}}, {}, "target.env.PYTHONPATH", "kvprobe does not set itself"),
    ({"launch": "engine", "env": ["A=1"]}, {}, "target.env", "a mapping of environment variables"),
    ({"launch": "engine", "env": {"1A": "x"}}, {}, "target.env.1A", "an environment variable name"),
    ({"launch": "engine", "command": "vllm serve 'unclosed"}, {}, "target.command", "balanced quotes"),
])
def test_bad_launch_options_are_one_line(tmp_path, target, keys, key, expect):
    message = refused(tmp_path, target, **keys)
    assert f": {key}: " in message and expect in message, message
    assert "hf_abc" not in message


def test_command_paths_resolve_against_the_expectation_folder(tmp_path):
    exp = load(tmp_path, {"launch": "engine", "command": "./venv/bin/vllm serve --config ../conf.yaml 'a b' ~/x"})
    base = tmp_path / "exp"
    assert exp.target.command == (str(base / "venv/bin/vllm"), "serve", "--config",
                                  str((base / "../conf.yaml").resolve()), "a b", str(Path("~/x").expanduser()))
    listed = load(tmp_path, {"launch": "engine", "command": ["bin/vllm", "serve"]})
    assert listed.target.command == (str(base / "bin/vllm"), "serve")
    plain = load(tmp_path, {"launch": "engine", "command": ["python", "-m", "sglang.launch_server"]})
    assert plain.target.command == ("python", "-m", "sglang.launch_server")


def test_launched_model_and_served_name_are_separate_from_the_theorys(tmp_path):
    (tmp_path / "exp" / "weights").mkdir(parents=True)
    exp = load(tmp_path, {"launch": "engine", "model": "./weights"}, served_model_name="llama")
    assert exp.model == "meta-llama/Llama-3.1-8B"  # the theory's model
    assert exp.launched_model == str(tmp_path / "exp" / "weights") and exp.served_name == "llama"
    default = load(tmp_path, {"launch": "engine"})
    assert default.launched_model == default.served_name == "meta-llama/Llama-3.1-8B"
    hub = load(tmp_path, {"launch": "engine", "model": "org/finetune"})
    assert hub.launched_model == "org/finetune" and hub.served_name == "meta-llama/Llama-3.1-8B"


def test_engine_launch_serves_the_name_clients_send(tmp_path, monkeypatch):
    """`launch: engine` with target.model: the engine loads that and serves the expectation's name."""
    from kvprobe.probe import run as probe
    from kvprobe.targets import launch as launcher

    seen = {}

    def fake_launch(argv, **kw):
        seen.update(argv=argv, **kw)
        return "target"

    monkeypatch.setattr(launcher.Target, "launch", staticmethod(fake_launch))
    exp = load(tmp_path, {"launch": "engine", "model": "org/finetune", "command": "vllm serve",
                          "env": {"OMP_NUM_THREADS": "2"}})
    probe.open_target(exp, probe.ProbeOptions(artifacts_dir=tmp_path), tmp_path)
    argv = seen["argv"]
    assert argv[:3] == ["vllm", "serve", "org/finetune"]
    assert argv[argv.index("--served-model-name") + 1] == "meta-llama/Llama-3.1-8B"
    assert seen["env"] == {"OMP_NUM_THREADS": "2"}


def test_engine_command_option_uses_shell_quoting():
    assert split_command("'/opt/my env/bin/vllm' serve --x \"a b\"") == ["/opt/my env/bin/vllm", "serve", "--x", "a b"]
    with pytest.raises(ConfigError, match="--engine-command.*balanced quotes"):
        split_command("vllm 'serve")
    with pytest.raises(ConfigError, match="empty"):
        split_command("  ")
