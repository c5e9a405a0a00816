"""vLLM's rules that change from release to release: the admission policy a version runs and the
budget defaults it starts from. The version strings themselves (the default release, the known
ones) are `kvprobe.releases`'; the engine's dialect (`kvprobe.engines.vllm`) and the ledger both ask
here, so a version runs the same policy in the emulator and in the ledger."""

from __future__ import annotations

from kvprobe.errors import ConfigError
from kvprobe.releases import VLLM_DEFAULT_VERSION, version_tuple

# `config/cache.py` gpu_memory_utilization default: 0.92 in 0.33.0 (L215), 0.9 in 0.11.0 and 0.9.2.
VLLM_GPU_MEMORY_UTILIZATION = {"0.33": 0.92, "0.11": 0.9, "0.9": 0.9}


def policy(version: str, *, reserve_full_isl: bool = True) -> str:
    """The admission policy (schedsim's name) of a vLLM version. 0.11 and older admit a prompt by
    its first chunk; later releases make the whole prompt fit before admitting it
    (vllm/v1/core/kv_cache_manager.py `allocate_slots(full_sequence_must_fit=...)`, set from
    vllm/config/scheduler.py `scheduler_reserve_full_isl`, on by default; off, they admit as 0.11
    does). The release that brought the flag lies between 0.11 and 0.33: 0.12 is taken as the first."""
    return "vllm-0.11" if version_tuple(version) < (0, 12) or not reserve_full_isl else "vllm-0.33"


def version_key(version: str | None, known: dict) -> str:
    v = (version or VLLM_DEFAULT_VERSION).lstrip("v")
    parts = v.split(".")
    for n in (2, 1):
        key = ".".join(parts[:n])
        if key in known:
            return key
    # Unknown versions: the newest rule we know for newer ones, the oldest for older ones.
    newest = max(known, key=lambda k: tuple(int(x) for x in k.split(".")))
    oldest = min(known, key=lambda k: tuple(int(x) for x in k.split(".")))
    try:
        mine = tuple(int(x) for x in parts[:2])
    except ValueError as err:
        raise ConfigError(f"expected an engine version like 0.33.0, got {version!r}",
                          key="engine_version") from err
    return newest if mine >= tuple(int(x) for x in newest.split(".")) else oldest


def vllm_default_gpu_memory_utilization(version: str | None = None) -> float:
    return VLLM_GPU_MEMORY_UTILIZATION[version_key(version, VLLM_GPU_MEMORY_UTILIZATION)]
