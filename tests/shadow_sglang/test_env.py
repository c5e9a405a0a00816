"""The installed SGLang 0.5.23 environment: the torchvision stand-in, the plugin's entry point, and
the plugin acting in a real SGLang process only when kvprobe's launch asks for it."""

from __future__ import annotations

import json
import os
import subprocess

from kvprobe.targets.shadow.pythonpath import kvprobe_pythonpath
from kvprobe.targets.shadow.sglang import env as env_module
from kvprobe.targets.shadow.sglang import plugin as sglang_plugin

PROBE_HOOKS = r"""
import json
from sglang.srt.plugins import load_plugins
load_plugins()  # what every SGLang process runs first (plugins/__init__.py)
from kvprobe.targets.shadow.sglang import plugin as sglang_plugin
from importlib.metadata import entry_points
print(json.dumps({
    "entry_points": [ep.value for ep in entry_points(group="sglang.srt.plugins")],
    "applied": {t: sglang_plugin.applied(t, fn) for t, fn in sglang_plugin.replacements()},
}))
"""


def _run_in_env(env, code: str, **extra) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVPROBE_SHADOW")}
    environ.update({"PYTHONPATH": str(kvprobe_pythonpath()), **extra})
    return subprocess.run([str(env.python), "-c", code], capture_output=True, text=True, timeout=300, env=environ)


def test_torchvision_is_a_stand_in_that_imports_and_refuses_to_run(sglang_env):
    code = ("import torchvision, transformers\n"
            "from torchvision.transforms import InterpolationMode\n"
            "import torchvision.transforms.v2.functional as F\n"
            "assert torchvision.STANDIN and 'stand-in' in repr(InterpolationMode.BICUBIC)\n"
            "try:\n    F.resize(None, 4)\nexcept RuntimeError as e:\n    print(e)\n")
    out = _run_in_env(sglang_env, code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torchvision is a stand-in in kvprobe's SGLang shadow environment" in out.stdout


def test_the_plugin_acts_only_when_kvprobe_shadow_is_set(sglang_env):
    off = _run_in_env(sglang_env, PROBE_HOOKS)
    assert off.returncode == 0, off.stderr[-2000:]
    seen = json.loads(off.stdout.strip().splitlines()[-1])
    assert seen["entry_points"] == [env_module.PLUGIN_TARGET]
    assert not any(seen["applied"].values()), seen  # SGLang's own code everywhere
    on = _run_in_env(sglang_env, PROBE_HOOKS, **{sglang_plugin.ACTIVE_ENV: "1"})
    assert on.returncode == 0, on.stderr[-2000:]
    applied = json.loads(on.stdout.strip().splitlines()[-1])["applied"]
    assert applied == {t: True for t in sglang_plugin.TARGETS.values()}, applied
