"""The vLLM 0.18.1 engine environment: the pinned CPU install plus a platform plugin; registered
here as the SGLang releases are in `kvprobe.targets.shadow.sglang.env` (0.33.0's recipe, pins
only, is in `kvprobe.targets.shadow.envs`).

0.18.1 is the last release before 0.19.0 brought whole-prompt admission (`scheduler_reserve_full_isl`;
kvprobe/theory/vllm/releases.py FULL_PROMPT_FROM): with it and 0.33.0, `kvprobe diff
expectations/diff/vllm-full-prompt-shadow.yaml --versions 0.18.1,0.33.0` runs both admission rules on
the engines' own code.

Install (measured 104 s with a warm pip cache, 2.2 GB): `pip install --no-deps -r pins/vllm-0.18.1.txt`,
then one step written here:

- `kvprobe_vllm_cpu_platform.py` and `kvprobe_shadow_vllm-<v>.dist-info`: `cpu_platform_plugin.py`
  copied as a top-level module, and a distribution with no other code whose entry point in vLLM's
  group `vllm.platform_plugins` names it. 0.18.1 picks the CPU platform only for a CPU build of vLLM
  (`VLLM_TARGET_DEVICE=cpu` is 0.33's rule); the plugin applies 0.33's rule, so the PyPI wheel starts.

Where the worker's interfaces differ between the two releases: `kvprobe.targets.shadow.vllm.compat`.
"""

from __future__ import annotations

from importlib import resources

import kvprobe
from kvprobe.releases import VLLM
from kvprobe.targets.shadow import envs

VERSION = "0.18.1"
PLUGIN_GROUP = "vllm.platform_plugins"  # vllm/plugins/__init__.py PLATFORM_PLUGINS_GROUP L19 (0.18.1)
PLUGIN_NAME = "kvprobe_cpu"
PLUGIN_MODULE = "kvprobe_vllm_cpu_platform"
PLUGIN_TARGET = f"{PLUGIN_MODULE}:cpu_platform"
DIST_NAME = "kvprobe_shadow_vllm"


def _plugin_source() -> str:
    return resources.files("kvprobe.targets.shadow.vllm").joinpath("cpu_platform_plugin.py").read_text("utf-8")


def files(version: str) -> dict[str, str]:
    """What the recipe writes under site-packages: the plugin module, then its distribution."""
    return {f"{PLUGIN_MODULE}.py": _plugin_source(), **_dist_files(version)}


def _dist_files(version: str) -> dict[str, str]:
    return envs.dist_info(DIST_NAME, version, "kvprobe's vLLM CPU platform plugin (0.33's VLLM_TARGET_DEVICE=cpu rule)",
                          f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = {PLUGIN_TARGET}\n", modules=(PLUGIN_MODULE,))


_CHECK = """
import os
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
from vllm.platforms import current_platform
assert current_platform.device_type == "cpu", current_platform
"""


def write_platform_plugin(env: envs.EngineEnv) -> None:
    envs.write_distribution(env, DIST_NAME, files(kvprobe.__version__), check=_CHECK,
                            what=f"vLLM does not pick the CPU platform through the {PLUGIN_GROUP} entry point")


RECIPE = envs.register(envs.Recipe(
    engine=VLLM, version=VERSION, module="vllm",
    steps=(
        envs.Pip(pins=f"vllm-{VERSION}.txt"),
        envs.Call(f"{PLUGIN_GROUP} entry point -> {PLUGIN_TARGET}", write_platform_plugin,
                  envs.revision(*files(kvprobe.__version__).values())),
    ),
    # the scheduler, the OpenAI server, and what the shadow worker subclasses and returns
    extra_checks=("vllm.v1.core.sched.scheduler", "vllm.entrypoints.openai.api_server",
                  "vllm.v1.worker.worker_base", "vllm.v1.outputs"),
    notes="torch 2.13.0 CPU build in place of vLLM's pinned 2.10.0; transformers 4.57.6, openai 2.24.0 "
          "(its METADATA caps them below 5 and 2.25); a vllm.platform_plugins entry point for the CPU platform",
))
