"""The engines kvprobe knows and the releases of each it has read: names, default versions and the
version arithmetic every stage shares. A leaf: the theory, the dialects, the targets and the faces
all read these from here, so the default release is written once.

The *rules* of a release (its admission policy, its budget defaults) live with the engine's theory
(`kvprobe/theory/vllm/releases.py`, `kvprobe/theory/sglang/releases.py`); the wire facts of a
release (log lines, metric names, error bodies) live in its dialect (`kvprobe/engines/`).
"""

from __future__ import annotations

import re

VLLM = "vllm"
SGLANG = "sglang"
ENGINES = (VLLM, SGLANG)

# The release each engine's facts are written for; a probe or ledger without a version takes it.
DEFAULT_VERSIONS = {VLLM: "0.33.0", SGLANG: "0.5.23"}
VLLM_DEFAULT_VERSION = DEFAULT_VERSIONS[VLLM]
SGLANG_DEFAULT_VERSION = DEFAULT_VERSIONS[SGLANG]

# Releases whose facts kvprobe holds: vLLM 0.33.0 throughout, 0.11.0 and 0.9.2 where they differ
# (two-line capacity log, first-chunk admission, error bodies, gauge names); the memory profile and the
# admission gate of 0.10.0-0.10.2 (0.10.1.1's, read in each wheel) and of every release from 0.11.0 to
# 0.32.0 with its patch releases (each wheel's config/cache.py, envs.py, v1/worker/gpu_worker.py,
# v1/sample/ops/topk_topp_sampler.py and v1/core read: kvprobe/theory/vllm/memory_profile.py,
# kvprobe/theory/vllm/releases.py; their other facts are those of the nearest release above); SGLang
# 0.5.23, and 0.5.21/0.5.22 where the ignore_eos reservation differs; the memory budget of SGLang
# 0.4.1.post7 to 0.4.10 and 0.5.0rc2 to 0.5.22 (kvprobe/theory/sglang/memory_profile.py; their other
# facts are those of 0.5.21).
KNOWN_VERSIONS = {VLLM: ("0.9.2", "0.10.0", "0.10.1", "0.10.1.1", "0.10.2", "0.11.0", "0.11.1", "0.11.2", "0.12.0",
                         "0.13.0", "0.14.0", "0.14.1", "0.15.0", "0.15.1", "0.16.0", "0.17.0", "0.17.1", "0.18.0",
                         "0.18.1", "0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1",
                         "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0",
                         "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"),
                  SGLANG: ("0.4.1.post7", "0.4.2", "0.4.2.post1", "0.4.2.post2", "0.4.2.post3", "0.4.2.post4",
                           "0.4.3", "0.4.3.post2", "0.4.3.post4", "0.4.4", "0.4.5", "0.4.6", "0.4.7",
                           "0.4.8", "0.4.9", "0.4.10", "0.5.0rc2", "0.5.1", "0.5.1.post1", "0.5.1.post2",
                           "0.5.1.post3", "0.5.2", "0.5.3", "0.5.3.post1", "0.5.3.post2", "0.5.3.post3", "0.5.4",
                           "0.5.4.post1", "0.5.4.post2", "0.5.4.post3", "0.5.5", "0.5.5.post1", "0.5.5.post2",
                           "0.5.5.post3", "0.5.6", "0.5.6.post1", "0.5.6.post2", "0.5.7", "0.5.8", "0.5.8.post1",
                           "0.5.9", "0.5.10", "0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13",
                           "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18",
                           "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")}


def normalize_version(version: str) -> str:
    """`0.33.0+cu128` -> `0.33.0`, `v0.5.23` -> `0.5.23`: a build label or a `v` does not change the code."""
    return str(version).strip().lstrip("vV").split("+", 1)[0]


def version_tuple(version: str) -> tuple[int, ...]:
    """The numeric release of a version string, at most three parts: `0.11.1rc2` -> (0, 11, 1)."""
    return tuple(int(p) for p in re.findall(r"\d+", normalize_version(version))[:3])
