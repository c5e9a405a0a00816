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


def normalize_version(version: str) -> str:
    """`0.33.0+cu128` -> `0.33.0`, `v0.5.23` -> `0.5.23`: a build label or a `v` does not change the code."""
    return str(version).strip().lstrip("vV").split("+", 1)[0]


def is_known_version(engine: str, version: str) -> bool:
    return normalize_version(version) in get_dialect(engine).KNOWN_VERSIONS


def unknown_version_message(engine: str, version: str, *, policy_hint: str = "`policy:`") -> str:
    """One line: the known versions, and how to choose an admission policy explicitly instead."""
    from kvprobe.theory.admission import POLICIES

    known = ", ".join(get_dialect(engine).KNOWN_VERSIONS)
    policies = ", ".join(p for p in POLICIES if p.startswith(engine) or p == "worst-case")
    return (f"a {engine} version kvprobe has facts for ({known}), or name the admission policy with "
            f"{policy_hint} ({policies}) to probe {version!r} under a rule you chose")
