"""Every environment kvprobe can build, by name: the registry of `kvprobe.targets.shadow.envs`
with each recipe in it. A recipe written in its own module (the SGLang plugin's entry point, the
fleet's router) registers itself when that module is imported; importing this module imports them
all, so a lookup by name here (`kvprobe shadow install/list`, an expectation's `launch: shadow`,
a shadow start, a test's engine environment) knows every recipe.
"""

from __future__ import annotations

from kvprobe.targets.shadow import disk, router_env
from kvprobe.targets.shadow.envs import (
    RECIPES,
    ensure,
    env_for,
    find,
    install,
    install_command,
    known_versions,
    parse_spec,
    recipe,
    require,
)
from kvprobe.targets.shadow.sglang import env as sglang_env
from kvprobe.targets.shadow.vllm import env as vllm_env

# The modules that register a recipe besides envs itself (its vLLM 0.33.0 recipe is all pins), and
# disk, which adds an install's last step (the files it has in common with the other environments shared).
RECIPE_MODULES = (sglang_env, vllm_env, router_env)
INSTALL_STEPS = (disk,)

__all__ = ["RECIPES", "RECIPE_MODULES", "ensure", "env_for", "find", "install", "install_command", "installed",
           "known_versions", "parse_spec", "recipe", "require"]


def installed(engine: str) -> list[str]:
    """The releases of `engine` whose current environment is complete here, oldest first (`kvprobe diff
    --versions installed`: a matrix over what this machine has built)."""
    return [v for v in known_versions(engine) if find(engine, v) is not None]
