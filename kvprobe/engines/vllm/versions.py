"""vLLM releases: which ones kvprobe knows, and what changes between them (the admission
policy, the async-scheduling default). vLLM 0.33.0; 0.11.0 / 0.9.2 where they differ."""

from __future__ import annotations

from kvprobe.releases import KNOWN_VERSIONS as _KNOWN
from kvprobe.releases import VLLM, VLLM_DEFAULT_VERSION, version_tuple
from kvprobe.theory.vllm.releases import (
    ASYNC_DEFAULT_FROM,
    policy,  # noqa: F401 — the admission policy of a release is the theory's rule
    vllm_default_gpu_memory_utilization,
)

NAME = VLLM
DEFAULT_VERSION = VLLM_DEFAULT_VERSION
# 0.33.0 throughout; 0.11.0 and 0.9.2 where they differ (two-line capacity log, first-chunk
# admission, error bodies, gauge names).
KNOWN_VERSIONS = _KNOWN[VLLM]


def is_legacy(version: str) -> bool:
    """0.11.x and older: the capacity log's block count, 400 for P + max_tokens > M (admission is
    kvprobe.theory.vllm.releases.policy's: the first chunk up to 0.18.x)."""
    return version_tuple(version) < (0, 12)


def two_line_capacity_log(version: str) -> bool:
    """0.27.x and older log the pool and the concurrency on two lines (v1/core/kv_cache_utils.py
    `get_kv_cache_configs`, 0.27.0 L2235-2239); 0.28.0 joined them into one (`update_kv_cache_capacity`,
    L1867-1873), which also stores `kv_cache_size_tokens` / `kv_cache_max_concurrency` in the
    CacheConfig that `vllm:cache_config_info` publishes. Read in the 0.25.0-0.28.0 and 0.30.0 wheels."""
    return version_tuple(version) < (0, 28)


def async_scheduling_default(version: str = DEFAULT_VERSION, *, platform: str = "cuda") -> bool:
    """Whether `vllm serve` schedules asynchronously when --async-scheduling is not given.

    0.33.0: `SchedulerConfig.async_scheduling` defaults to None (config/scheduler.py L211) and
    `VllmConfig.__post_init__` turns it on unless the model pools, the executor cannot, or the V1
    runner is incompatible (config/vllm.py L1685-1719); the CPU platform forces it off
    (platforms/cpu.py L348). It arrived opt-in (vllm-project/vllm#19970): `async_scheduling: bool =
    False` in config/scheduler.py up to 0.13.0 (L133); 0.14.0 made it `Field(default=None)` (L133),
    which `VllmConfig.__post_init__` turns on (config/vllm.py L588-628). Read in every wheel 0.11.0-0.15.0."""
    if platform == "cpu":
        return False
    return version_tuple(version) >= ASYNC_DEFAULT_FROM


# 0.34.0: CacheConfig.gpu_memory_utilization defaults to None (config/cache.py L216) and the engine resolves
# it apart (`resolved_gpu_memory_utilization`, L494-501) without writing it back, so `vllm:cache_config_info`
# and /server_info publish None unless the flag was given (a 0.34.0 shadow's /metrics:
# gpu_memory_utilization="None"). Before, the field held the default (0.9, 0.92 from 0.20.0).
UTILISATION_UNRESOLVED_FROM = (0, 34)
# 0.34.0 leaves `usage.prompt_tokens_details` out of a body when it is None, where 0.33.0 wrote null
# (entrypoints/serve/engine/protocol.py L139-141).
PROMPT_TOKENS_DETAILS_OMITTED_FROM = (0, 34)


def published_gpu_memory_utilization(version: str, given: float | None) -> float | None:
    """The utilisation a release publishes in its config: the flag, else its default, else (0.34.0 on) None."""
    if given is not None:
        return given
    if version_tuple(version) >= UTILISATION_UNRESOLVED_FROM:
        return None
    return vllm_default_gpu_memory_utilization(version)


def prompt_tokens_details_written(version: str) -> bool:
    return version_tuple(version) < PROMPT_TOKENS_DETAILS_OMITTED_FROM
