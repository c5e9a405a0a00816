"""`kvprobe diff FILE --versions installed`: every release whose shadow environment is built on this
machine, oldest first (`make matrix` runs the shipped pairs' shapes across them), and the bad input
refused before anything is launched."""

from __future__ import annotations

import json
from pathlib import Path

from kvprobe.targets.shadow import envs, recipes
from tests.cli.console import run
from tests.shadow_env.test_envs import cache  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]
SHADOW = str(REPO / "expectations" / "diff" / "vllm-full-prompt-shadow.yaml")
EMULATED = str(REPO / "expectations" / "diff" / "vllm-first-chunk.yaml")


def _built(engine: str, version: str, *, digest: str | None = None) -> None:
    """An environment folder as a finished install leaves it: its interpreter and its marker, written last."""
    env = envs.env_for(engine, version)
    env.python.parent.mkdir(parents=True)
    env.python.write_text("")
    rec = envs.recipe(engine, version)
    (env.root / envs.MARKER).write_text(json.dumps({"engine": engine, "version": version,
                                                    "digest": digest or rec.digest}))


def test_installed_is_every_complete_environment_oldest_first(cache):  # noqa: F811
    for version in ("0.33.0", "0.18.1", "0.24.0"):
        _built("vllm", version)
    _built("vllm", "0.19.1", digest="an-older-recipe")  # an outdated install is not a release to run
    _built("sglang", "0.5.22")
    assert recipes.installed("vllm") == ["0.18.1", "0.24.0", "0.33.0"]
    assert recipes.installed("sglang") == ["0.5.22"]


def test_fewer_than_two_installed_names_the_install_command(cache, capsys):  # noqa: F811
    _built("vllm", "0.33.0")
    rc, out, err = run(capsys, "diff", SHADOW, "--versions", "installed", "--artifacts", str(cache / "art"))
    assert rc == 2 and out == ""
    assert "--versions: expected two or more installed vllm shadow environments" in err
    assert "found 0.33.0" in err and "kvprobe shadow install vllm==VERSION" in err and SHADOW in err


def test_installed_needs_a_shadow_target(cache, capsys):  # noqa: F811
    rc, out, err = run(capsys, "diff", EMULATED, "--versions", "installed", "--artifacts", str(cache / "art"))
    assert rc == 2 and out == ""
    assert "expected a `launch: shadow` target for --versions installed" in err and "'emulator'" in err
