"""The SGLang engine environments (0.5.14 to 0.5.23): the pinned CPU install, a torchvision stand-in,
and the entry point through which SGLang loads kvprobe's plugin.

Install (measured 1-2 min with a warm pip cache, 2.5 GB):
`pip install --no-deps -r pins/sglang-<version>.txt` (torch 2.13.0 CPU build, sglang, triton, and
SGLang's pure-Python runtime set), then two steps written here:

- `torchvision/`: `torchvision_standin.py` copied as the package (SGLang imports torchvision at
  module level; no CPU wheel of it loads with this torch).
- `kvprobe_shadow_sglang-<v>.dist-info`: a distribution with no code, only an entry point in the
  group `sglang.srt.plugins` -> `kvprobe.targets.shadow.sglang.plugin:register`. SGLang's
  `load_plugins()` finds it in every one of its processes. It acts only with KVPROBE_SHADOW=1,
  and `kvprobe` itself is not installed in the environment: the shadow launch puts a folder
  holding only the `kvprobe` package on PYTHONPATH (`pythonpath.kvprobe_pythonpath`), so the
  environment never depends on one checkout of kvprobe, and kvprobe's own dependencies never
  shadow the engine's.
"""

from __future__ import annotations

from importlib import resources

import kvprobe
from kvprobe.releases import SGLANG, SGLANG_DEFAULT_VERSION
from kvprobe.targets.shadow import envs

PLUGIN_GROUP = "sglang.srt.plugins"  # sglang/srt/plugins/__init__.py GENERAL_PLUGINS_GROUP (0.5.23)
PLUGIN_NAME = "kvprobe_shadow"
PLUGIN_TARGET = "kvprobe.targets.shadow.sglang.plugin:register"
DIST_NAME = "kvprobe_shadow_sglang"


def _standin_source() -> str:
    return resources.files("kvprobe.targets.shadow.sglang").joinpath("torchvision_standin.py").read_text("utf-8")


def write_torchvision_standin(env: envs.EngineEnv) -> None:
    pkg = env.site_packages / "torchvision"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(_standin_source())


def files(version: str) -> dict[str, str]:
    """What the recipe writes under site-packages: the plugin's distribution (the plugin is kvprobe's)."""
    return envs.dist_info(DIST_NAME, version,
                          "kvprobe's SGLang shadow plugin (entry point only; acts with KVPROBE_SHADOW=1)",
                          f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = {PLUGIN_TARGET}\n")


_CHECK_ENTRY_POINT = f"""
from importlib.metadata import entry_points
found = [ep.value for ep in entry_points(group={PLUGIN_GROUP!r}) if ep.name == {PLUGIN_NAME!r}]
assert found == [{PLUGIN_TARGET!r}], found
"""


def write_plugin_entry_point(env: envs.EngineEnv) -> None:
    envs.write_distribution(env, DIST_NAME, files(kvprobe.__version__), check=_CHECK_ENTRY_POINT,
                            what=f"the {PLUGIN_GROUP} entry point is not visible", timeout=120)


# The releases with a recipe, and what each recipe does differently from SGLang's own pins.
_STANDIN = "triton without dependencies; torchvision is kvprobe's stand-in"
TORCH_NOTES = {
    "0.5.14": f"torch 2.13.0 CPU build in place of SGLang 0.5.14's pinned 2.11.0; transformers 5.8.1, "
              f"apache-tvm-ffi 0.1.9 and xgrammar 0.2.1 (its pins); {_STANDIN}",
    "0.5.15.post1": f"torch 2.13.0 CPU build in place of SGLang 0.5.15.post1's pinned 2.11.0; xgrammar 0.2.1 "
                    f"(its pin); {_STANDIN}",
    "0.5.16": f"torch 2.13.0 CPU build in place of SGLang 0.5.16's pinned 2.11.0; xgrammar 0.2.1 (its pin); "
              f"{_STANDIN}",
    "0.5.17": f"torch 2.13.0 CPU build in place of SGLang 0.5.17's pinned 2.11.0; xgrammar 0.2.1 (its pin); "
              f"{_STANDIN}",
    "0.5.18": f"torch 2.13.0 CPU build (SGLang 0.5.18's own pin); xgrammar 0.2.1 (its pin); {_STANDIN}",
    "0.5.19": f"torch 2.13.0 CPU build (SGLang 0.5.19's own pin); xgrammar 0.2.1 (its pin); {_STANDIN}",
    "0.5.20": f"torch 2.13.0 CPU build (SGLang 0.5.20's own pin); xgrammar 0.2.1 (its pin); {_STANDIN}",
    "0.5.21": "torch 2.13.0 CPU build (SGLang 0.5.21's own pin); triton without dependencies; "
              "torchvision is kvprobe's stand-in",
    "0.5.22": "torch 2.13.0 CPU build in place of SGLang 0.5.22's pinned 2.14.1; triton without dependencies; "
              "torchvision is kvprobe's stand-in",
    SGLANG_DEFAULT_VERSION: "torch 2.13.0 CPU build in place of SGLang's pinned 2.14.1; triton without dependencies; "
                            "torchvision is kvprobe's stand-in",
}


def _recipe(version: str) -> envs.Recipe:
    return envs.Recipe(
        engine=SGLANG, version=version, module="sglang",
        steps=(
            envs.Pip(pins=f"sglang-{version}.txt"),
            envs.Call("torchvision stand-in", write_torchvision_standin, envs.revision(_standin_source())),
            envs.Call(f"{PLUGIN_GROUP} entry point -> {PLUGIN_TARGET}", write_plugin_entry_point,
                      envs.revision(*files(kvprobe.__version__).values())),
        ),
        # the scheduler, the model runner the plugin hooks, the HTTP server, and a torchvision submodule
        extra_checks=("sglang.srt.managers.scheduler", "sglang.srt.model_executor.model_runner",
                      "sglang.srt.entrypoints.http_server", "torchvision.transforms.v2.functional"),
        notes=TORCH_NOTES[version],
    )


RECIPES = {version: envs.register(_recipe(version)) for version in TORCH_NOTES}
RECIPE = RECIPES[SGLANG_DEFAULT_VERSION]
