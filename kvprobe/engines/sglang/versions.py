"""SGLang releases: which ones kvprobe knows, and what changes between them (the admission
reservation of ignore_eos requests). SGLang 0.5.23; 0.5.22 and 0.5.21 where they differ."""

from __future__ import annotations

from kvprobe.releases import KNOWN_VERSIONS as _KNOWN
from kvprobe.releases import SGLANG, SGLANG_DEFAULT_VERSION
from kvprobe.theory.sglang.releases import (
    policy,  # noqa: F401 — the admission policy of a release is the theory's rule
    scheduler_rules,  # noqa: F401 — and its scheduler loop's rules
)

NAME = SGLANG
DEFAULT_VERSION = SGLANG_DEFAULT_VERSION
# 0.5.23 throughout; 0.5.22 and 0.5.21 where the admission reservation of ignore_eos requests
# differs (`policy`, the theory's release rule).
KNOWN_VERSIONS = _KNOWN[SGLANG]
