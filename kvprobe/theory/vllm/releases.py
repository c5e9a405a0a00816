"""vLLM's rules that change from release to release: the admission policy a version runs and the
budget defaults it starts from. The version strings themselves (the default release, the known
ones) are `kvprobe.releases`'; the engine's dialect (`kvprobe.engines.vllm`) and the ledger both ask
here, so a version runs the same policy in the emulator and in the ledger."""

from __future__ import annotations

from kvprobe.releases import VLLM_DEFAULT_VERSION, version_tuple
from kvprobe.theory.vllm.memory_profile import profile_rules


def policy(version: str, *, reserve_full_isl: bool = True) -> str:
    """The admission policy (schedsim's name) of a vLLM version. 0.11 and older admit a prompt by
    its first chunk; later releases make the whole prompt fit before admitting it
    (vllm/v1/core/kv_cache_manager.py `allocate_slots(full_sequence_must_fit=...)`, set from
    vllm/config/scheduler.py `scheduler_reserve_full_isl`, on by default; off, they admit as 0.11
    does). The release that brought the flag lies between 0.11 and 0.33: 0.12 is taken as the first."""
    return "vllm-0.11" if version_tuple(version) < (0, 12) or not reserve_full_isl else "vllm-0.33"


def vllm_default_gpu_memory_utilization(version: str | None = None) -> float:
    """`config/cache.py`'s default: 0.9 up to 0.19.0, 0.92 from 0.20.0 (memory_profile.RULES names the lines)."""
    return profile_rules(version or VLLM_DEFAULT_VERSION).gpu_memory_utilization


# What each policy's rule says, in the words a diff between two releases names it with (`kvprobe diff`).
RULES = {"vllm-0.11": "a prompt is admitted when its first chunk fits, before 0.12",
         "vllm-0.33": "whole prompt must fit from 0.12 (scheduler_reserve_full_isl on by default)"}
