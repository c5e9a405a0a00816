"""Engine dialects: `get_dialect("vllm" | "sglang")` returns the package holding that engine's facts
(`kvprobe/engines/vllm/`, `kvprobe/engines/sglang/`). The engine names and releases themselves are
written in `kvprobe.releases`; `ENGINES` and `normalize_version` are re-exported here for the dialects' callers."""

from __future__ import annotations

import importlib
from types import ModuleType

from kvprobe.engines.base import OptionalFacts
from kvprobe.errors import ConfigError
from kvprobe.releases import ENGINES, normalize_version

__all__ = ["ENGINES", "get_dialect", "is_known_version", "normalize_version", "unknown_version_message"]


def get_dialect(name: str) -> ModuleType:
    """The dialect module of `name`, with every optional fact it leaves out defaulted
    (`kvprobe.engines.base.OptionalFacts`); ConfigError naming the known engines otherwise."""
    key = (name or "").strip().lower()
    if key not in ENGINES:
        raise ConfigError(f"unknown engine {name!r}: expected one of {', '.join(ENGINES)}", key="engine")
    return OptionalFacts.apply(importlib.import_module(f"kvprobe.engines.{key}"))


def is_known_version(engine: str, version: str) -> bool:
    return normalize_version(version) in get_dialect(engine).KNOWN_VERSIONS


def unknown_version_message(engine: str, version: str, *, policy_hint: str = "`policy:`") -> str:
    """One line: the known versions, and how to choose an admission policy explicitly instead."""
    from kvprobe.theory.admission import POLICIES

    known = ", ".join(get_dialect(engine).KNOWN_VERSIONS)
    policies = ", ".join(p for p in POLICIES if p.startswith(engine) or p == "worst-case")
    return (f"a {engine} version kvprobe has facts for ({known}), or name the admission policy with "
            f"{policy_hint} ({policies}) to probe {version!r} under a rule you chose")
