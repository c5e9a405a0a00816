"""Bad input and failures of the SGLang shadow: one clear line each, bounded in time, nothing left
running. The start-up failure runs real SGLang 0.5.23; the others stop before anything starts."""

from __future__ import annotations

import json
import time

import pytest

from kvprobe.cli.main import main
from kvprobe.errors import TargetError
from kvprobe.procgroup import free_port, group_members
from kvprobe.targets.launch import Target
from kvprobe.targets.shadow import envs, launch, settings
from kvprobe.targets.shadow.target import ShadowTarget

from .conftest import shipped

LLAMA = "meta-llama/Llama-3.1-8B"


@pytest.fixture
def launched(monkeypatch):
    """Every Target constructed (a launch that got as far as starting a process)."""
    seen: list = []
    init = Target.__init__

    def target_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append(self)

    monkeypatch.setattr(Target, "__init__", target_init)
    return seen


def test_a_version_with_no_pinned_list(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(envs.CACHE_ENV, str(tmp_path / "cache"))
    assert main(["shadow", "install", "sglang==0.5.99"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("kvprobe shadow: error: no pinned install list for sglang 0.5.99: kvprobe can build shadow "
                   "environments for sglang==0.5.14, sglang==0.5.15.post1, sglang==0.5.16, sglang==0.5.17, "
                   "sglang==0.5.18, sglang==0.5.19, sglang==0.5.20, sglang==0.5.21, sglang==0.5.22, sglang==0.5.23")
    assert not (tmp_path / "cache" / "envs").exists()


def test_the_console_names_the_install_command_when_the_env_is_missing(tmp_path, monkeypatch, capsys, launched):
    monkeypatch.setenv(envs.CACHE_ENV, str(tmp_path / "cache"))
    rc = main(["shadow", "sglang", "--model-path", LLAMA, "--max-total-tokens", "16384", "--port", str(free_port())])
    err = capsys.readouterr().err.strip()
    assert rc == 3 and len(err.splitlines()) == 1, err
    assert "the sglang 0.5.23 engine environment is not installed" in err
    assert "run `kvprobe shadow install sglang==0.5.23`" in err
    assert launched == []


def test_an_outdated_env_is_refused_with_the_same_command(tmp_path, monkeypatch):
    """An environment of an older recipe (another pin list: another digest) is not this one."""
    monkeypatch.setenv(envs.CACHE_ENV, str(tmp_path / "cache"))
    old = envs.env_for("sglang", "0.5.23").root.with_name("sglang-0.5.23-0123456789abcdef")
    (old / "bin").mkdir(parents=True)
    (old / "bin" / "python").write_text("")
    (old / envs.MARKER).write_text(json.dumps({"digest": "0123456789abcdef"}))
    with pytest.raises(envs.EnvError, match=r"is out of date .*run `kvprobe shadow install sglang==0\.5\.23`"):
        envs.require("sglang", "0.5.23")


def test_a_pool_that_does_not_fit_in_memory_starts_nothing(sglang_env, capsys, launched):
    rc = main(["shadow", "sglang", "--model-path", LLAMA, "--max-total-tokens", "4000000",
               "--context-length", "2048", "--port", str(free_port())])
    err = capsys.readouterr().err.strip()
    assert rc == 3 and len(err.splitlines()) == 1, err
    assert "does not fit in this machine's memory: its KV pool of 4000000 tokens takes 488.28 GiB" in err
    assert launched == []


@pytest.mark.slow
def test_sglang_exiting_during_start_up_is_one_error_with_the_log_tail(sglang_env, tmp_path, launched):
    """The plugin fails inside SGLang's scheduler process (a time model it cannot read): SGLang's
    launcher tears the server down, and kvprobe reports it with the log's tail; the group is gone."""
    exp = shipped("shadow-sglang-kv")
    req = launch.ShadowLaunch(engine="sglang", version="0.5.23", model=exp.model, config=_config(),
                              served_model_name=LLAMA, flags=dict(exp.flags), port=free_port(),
                              extra_env={settings.TIME_MODEL_ENV: "fast"})
    argv, environ = launch.command(req)
    t0 = time.monotonic()
    with pytest.raises(TargetError) as info:
        ShadowTarget.launch(argv, engine="sglang", port=req.port, log_path=str(tmp_path / "engine.log"),
                            startup_timeout=300, env=environ)
    took = time.monotonic() - t0
    message = str(info.value)
    first = message.splitlines()[0]
    assert first.startswith("sglang exited with code") and "during start-up" in first, first
    assert "time model: expected name=value" in info.value.log_tail
    assert took < 120, took
    assert len(launched) == 1
    # SGLang's children outlive its launcher here, so they are reparented to init: a zombie may wait
    # there to be reaped for a moment; no live member of the group is left (procgroup's rule).
    assert group_members(launched[0].pgid) == []


def _config() -> dict:
    from kvprobe.theory.model.geometry import load_model_config

    return load_model_config(LLAMA)[0]
