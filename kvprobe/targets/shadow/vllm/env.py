"""The vLLM engine environments of the releases before 0.33.0 that kvprobe has a recipe for: 0.18.1 and
0.19.1 (either side of 0.19.0's whole-prompt admission) and the latest patch of each minor release 0.20
to 0.25 (0.20.2, 0.21.0, 0.22.1, 0.23.0, 0.24.0, 0.25.1): each the pinned CPU install plus a platform
plugin; registered here as the SGLang releases are in `kvprobe.targets.shadow.sglang.env` (0.33.0's recipe,
pins only, is in `kvprobe.targets.shadow.envs`). One recipe, `_recipe(version)`; what differs per release
is data (`RELEASES`: its pin list and its notes).

0.19.0 brought whole-prompt admission (`scheduler_reserve_full_isl`, on by default: vllm/config/scheduler.py
L139 and v1/core/sched/scheduler.py L732-744 in 0.19.1; kvprobe/theory/vllm/releases.py FULL_PROMPT_FROM).
0.18.1 is the last release before it, 0.19.1 the one after: `kvprobe diff
expectations/diff/vllm-full-prompt-shadow.yaml --versions 0.18.1,0.19.1` runs both admission rules on
adjacent releases' own code (0.18.1 with 0.33.0 is the pair `make test` runs). 0.23.0 and 0.24.0 are either
side of `--watermark` (release-changes.md V9; v1/core/kv_cache_manager.py L163, L363-385 in 0.24.0).

Install (measured 104 s with a warm pip cache, 2.2 GB, for 0.18.1; 362-382 s for 0.23.0 and 0.24.0 on a busy
machine): `pip install --no-deps -r pins/vllm-<v>.txt`, then one step written here:

- `kvprobe_vllm_cpu_platform.py` and `kvprobe_shadow_vllm-<v>.dist-info`: `cpu_platform_plugin.py`
  copied as a top-level module, and a distribution with no other code whose entry point in vLLM's
  group `vllm.platform_plugins` names it. 0.18.1 to 0.25.1 pick the CPU platform only for a CPU build
  of vLLM (vllm/platforms/__init__.py `cpu_platform_plugin`, L163-185 in 0.18.1-0.23.0, L162-184 in 0.24.0
  and 0.25.1; `VLLM_TARGET_DEVICE=cpu` is 0.33's rule); the plugin applies 0.33's rule, so the PyPI wheel
  starts.

Where the worker's interfaces differ between these releases and 0.33.0: `kvprobe.targets.shadow.vllm.compat`.
"""

from __future__ import annotations

from importlib import resources

import kvprobe
from kvprobe.releases import VLLM, version_tuple
from kvprobe.targets.shadow import envs

# The release `make test` runs beside 0.33.0 (tests/shadow/test_vllm_release_pair.py; `kvprobe shadow
# prune` keeps it by default, kvprobe/targets/shadow/disk.py SUITE_RELEASES).
VERSION = "0.18.1"
# vllm/plugins/__init__.py PLATFORM_PLUGINS_GROUP: L19 in 0.18.1-0.25.1, L23 in 0.26.0 and 0.27.1
PLUGIN_GROUP = "vllm.platform_plugins"
# The first release whose vllm/platforms/__init__.py picks the CPU platform for VLLM_TARGET_DEVICE=cpu, so
# that the PyPI wheel starts with no plugin: 0.28.0 (`cpu_platform_plugin` L162-168: `is_cpu =
# envs.VLLM_TARGET_DEVICE == "cpu"`; 0.29.0-0.32.0 the same, L174-182). 0.27.1's L162-198 and 0.26.0's
# take it only for a CPU build or macOS, as 0.18.1's do. Releases before it get the plugin.
TARGET_DEVICE_RULE_FROM = (0, 28)
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


# The releases with this recipe, and what each does differently from vLLM's own pins (the pin list
# itself is pins/vllm-<version>.txt; each file's header says which METADATA lines it follows).
RELEASES = {
    VERSION: "torch 2.13.0 CPU build in place of vLLM's pinned 2.10.0; transformers 4.57.6, openai 2.24.0 "
             "(its METADATA caps them below 5 and 2.25); a vllm.platform_plugins entry point for the CPU platform",
    "0.19.1": "torch 2.13.0 CPU build in place of vLLM's pinned 2.10.0; 0.18.1's pins but compressed-tensors "
              "0.15.0.1 (its METADATA); a vllm.platform_plugins entry point for the CPU platform",
    "0.20.2": "torch 2.13.0 CPU build in place of vLLM's pinned 2.11.0; 0.19.1's pins (its METADATA moves none "
              "the shadow imports); a vllm.platform_plugins entry point for the CPU platform",
    "0.21.0": "torch 2.13.0 CPU build in place of vLLM's pinned 2.11.0; 0.19.1's pins (its METADATA moves none "
              "the shadow imports); a vllm.platform_plugins entry point for the CPU platform",
    "0.22.1": "torch 2.13.0 CPU build in place of vLLM's pinned 2.11.0; 0.19.1's pins but llguidance 1.7.6 "
              "(its METADATA); a vllm.platform_plugins entry point for the CPU platform",
    "0.23.0": "torch 2.13.0 CPU build in place of vLLM's pinned 2.11.0; 0.19.1's pins but llguidance 1.7.6 and "
              "compressed-tensors 0.17.0 (its METADATA); a vllm.platform_plugins entry point for the CPU platform",
    "0.24.0": "torch 2.13.0 CPU build in place of vLLM's pinned 2.11.0; 0.23.0's pins but transformers 5.20.2 with "
              "huggingface-hub 2.4.0 and tokenizers 0.23.3 (its METADATA: transformers>=5.5.3); "
              "a vllm.platform_plugins entry point for the CPU platform",
    "0.25.1": "torch 2.13.0 CPU build in place of vLLM's pinned 2.11.0; 0.24.0's pins but openai 3.57.0 (its "
              "tool_parsers/utils.py imports openai's NamespaceTool); a vllm.platform_plugins entry point for the CPU "
              "platform",
    # 0.26.0-0.32.0 (kvprobe issue 23): 0.33.0's pins but what each METADATA moves (pins/vllm-<v>.txt's header)
    "0.26.0": "torch 2.13.0 CPU build in place of vLLM's pinned 2.11.0; 0.33.0's pins but apache-tvm-ffi 0.1.10 "
              "and openai-harmony 0.0.8 for oss-harmony (its METADATA), xgrammar 0.2.7 (0.2.8 needs tvm-ffi "
              "0.1.11); a vllm.platform_plugins entry point for the CPU platform",
    "0.27.1": "torch 2.13.0 CPU build (its own pin); 0.33.0's pins but openai-harmony 0.0.8 for oss-harmony "
              "(its METADATA); a vllm.platform_plugins entry point for the CPU platform",
    "0.28.0": "torch 2.13.0 CPU build (its own pin); 0.33.0's pins but openai-harmony 0.0.8 for oss-harmony "
              "(its METADATA); picks the CPU platform for VLLM_TARGET_DEVICE=cpu itself",
    "0.29.0": "torch 2.13.0 CPU build (its own pin); 0.33.0's pins but openai-harmony 0.0.8 for oss-harmony "
              "(its METADATA)",
    "0.30.0": "torch 2.13.0 CPU build (its own pin); 0.33.0's pins but openai-harmony 0.0.8 for oss-harmony "
              "(its METADATA)",
    "0.31.0": "torch 2.13.0 CPU build (its own pin); 0.33.0's pins but transformers 5.17.0 (its METADATA caps it "
              "below 5.18) with huggingface-hub 1.33.0, httpx 0.29.0, httpcore 1.0.9, and xgrammar 0.2.7",
    "0.32.0": "torch 2.13.0 CPU build (its own pin); 0.33.0's pins but transformers 5.19.0 (its METADATA caps it "
              "below 5.20)",
    # the release after the default: its CPU platform refuses x86 without Triton (pins/vllm-0.34.0.txt's header)
    "0.34.0": "torch 2.13.0 CPU build in place of vLLM's pinned 2.14.0; 0.33.0's pins and triton 3.8.0 (torch 2.14's "
              "own pin), which its CPU platform requires on x86 (the launcher sets CUDA_VISIBLE_DEVICES=\"\" so "
              "that vLLM accepts a Triton with no active GPU driver)",
}


def needs_platform_plugin(version: str) -> bool:
    """Whether this release needs the CPU platform plugin: one before `TARGET_DEVICE_RULE_FROM`."""
    return version_tuple(version) < TARGET_DEVICE_RULE_FROM


def _steps(version: str) -> tuple[envs.Pip | envs.Call, ...]:
    pip = envs.Pip(pins=f"vllm-{version}.txt")
    if not needs_platform_plugin(version):
        return (pip,)
    return (pip, envs.Call(f"{PLUGIN_GROUP} entry point -> {PLUGIN_TARGET}", write_platform_plugin,
                           envs.revision(*files(kvprobe.__version__).values())))


def _recipe(version: str) -> envs.Recipe:
    return envs.Recipe(
        engine=VLLM, version=version, module="vllm", steps=_steps(version),
        # the scheduler, the OpenAI server, and what the shadow worker subclasses and returns
        extra_checks=("vllm.v1.core.sched.scheduler", "vllm.entrypoints.openai.api_server",
                      "vllm.v1.worker.worker_base", "vllm.v1.outputs"),
        notes=RELEASES[version],
    )


RECIPES = {version: envs.register(_recipe(version)) for version in RELEASES}
RECIPE = RECIPES[VERSION]
