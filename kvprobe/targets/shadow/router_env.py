"""The fleet's router environment: sglang-router, installed like an engine (pinned, `--no-deps`,
import-checked) though it is not one. Its recipe lives with the other environments so that the
registry (`recipes.py`) knows it without importing the fleet; the fleet's router reads its name
and version from here."""

from __future__ import annotations

from kvprobe.targets.shadow.envs import Pip, Recipe, register

NAME = "sglang-router"
VERSION = "0.3.2"

RECIPE = register(Recipe(
    engine=NAME, version=VERSION, module="sglang_router", steps=(Pip(pins=f"{NAME}-{VERSION}.txt"),),
    extra_checks=("sglang_router.sglang_router_rs", "sglang_router.launch_router"),
    notes="the router's Rust extension and its light Python dependencies (pins/sglang-router-0.3.2.txt)"))
