"""Engine dialects: `get_dialect("vllm" | "sglang")` returns the module holding that engine's facts."""

from __future__ import annotations

import importlib
from types import ModuleType

from kvprobe.errors import ConfigError

ENGINES = ("vllm", "sglang")


def get_dialect(name: str) -> ModuleType:
    """The dialect module of `name`; ConfigError naming the known engines otherwise."""
    key = (name or "").strip().lower()
    if key not in ENGINES:
        raise ConfigError(f"unknown engine {name!r}: expected one of {', '.join(ENGINES)}", key="engine")
    return importlib.import_module(f"kvprobe.engines.{key}")
