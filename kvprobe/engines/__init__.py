"""Engine dialects: `get_dialect("vllm" | "sglang")` returns the module holding that engine's facts."""

from __future__ import annotations

import importlib
from types import ModuleType

from kvprobe.engines.base import OptionalFacts
from kvprobe.errors import ConfigError

ENGINES = ("vllm", "sglang")


def get_dialect(name: str) -> ModuleType:
    """The dialect module of `name`, with every optional fact it leaves out defaulted
    (`kvprobe.engines.base.OptionalFacts`); ConfigError naming the known engines otherwise."""
    key = (name or "").strip().lower()
    if key not in ENGINES:
        raise ConfigError(f"unknown engine {name!r}: expected one of {', '.join(ENGINES)}", key="engine")
    return OptionalFacts.apply(importlib.import_module(f"kvprobe.engines.{key}"))
