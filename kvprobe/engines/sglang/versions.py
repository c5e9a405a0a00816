"""SGLang releases: which ones kvprobe knows, and what changes between them (the admission
reservation of ignore_eos requests). SGLang 0.5.23; 0.5.22 and 0.5.21 where they differ."""

from __future__ import annotations

from kvprobe.releases import KNOWN_VERSIONS as _KNOWN
from kvprobe.releases import SGLANG, SGLANG_DEFAULT_VERSION
from kvprobe.releases import version_tuple as _vt

NAME = SGLANG
DEFAULT_VERSION = SGLANG_DEFAULT_VERSION
# 0.5.23 throughout; 0.5.22 and 0.5.21 where the admission reservation of ignore_eos requests
# differs (policy() below).
KNOWN_VERSIONS = _KNOWN[SGLANG]


def policy(version: str) -> str:
    """0.5.22 reserves ignore_eos requests at ratio 1.0; 0.5.21 and older scale by new_token_ratio."""
    return "sglang-0.5.21" if _vt(version) <= (0, 5, 21) else "sglang-0.5.22"
