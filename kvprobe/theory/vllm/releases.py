"""vLLM's rules that change from release to release: the admission policy a version runs and the
budget defaults it starts from. The version strings themselves (the default release, the known
ones) are `kvprobe.releases`'; the engine's dialect (`kvprobe.engines.vllm`) and the ledger both ask
here, so a version runs the same policy in the emulator and in the ledger."""

from __future__ import annotations

from dataclasses import dataclass

from kvprobe.releases import VLLM_DEFAULT_VERSION, version_tuple
from kvprobe.theory.vllm.hybrid.block_pool import SPLIT, TAIL, WINDOW_SPLIT
from kvprobe.theory.vllm.memory_profile import profile_rules

# The first release that makes the whole prompt fit before admitting it: 0.19.0 brought
# `scheduler_reserve_full_isl` (config/scheduler.py L139, default True) and the gate in
# v1/core/sched/scheduler.py L732-744 (`kv_cache_manager.can_fit_full_sequence`, kv_cache_manager.py
# L218-248). None of 0.11.0-0.18.1 has the flag or any full-sequence check: they allocate the first chunk.
# 0.21.0 moved the check into `allocate_slots(full_sequence_must_fit=...)` (kv_cache_manager.py L235).
FULL_PROMPT_FROM = (0, 19)
# The first release with `--watermark` (release-changes.md V9, PR #44594): 0.24.0's config/scheduler.py
# L146 `watermark: float = Field(default=0.0, ge=0.0, lt=1.0)`; v1/core/kv_cache_manager.py L163
# `watermark_blocks = int(watermark * num_blocks)`, kept free on top of a WAITING or PREEMPTED request's
# blocks when another request is scheduled (L363-371, the full-sequence gate L385, the allocation
# L415-419). 0.23.0 has no such flag (neither config/scheduler.py nor engine/arg_utils.py names it), and
# at the default 0.0 0.24.0 admits as 0.23.0 does (0 blocks kept).
WATERMARK_FROM = (0, 24)
# The first release that schedules asynchronously when --async-scheduling is not given (config/scheduler.py
# `Field(default=None)` from 0.14.0, L133; `async_scheduling: bool = False` up to 0.13.0): the dialect's
# `async_scheduling_default` reads the wheels' details.
ASYNC_DEFAULT_FROM = (0, 14)
# The first release with `--max-num-active-seqs`, a cap on RUNNING below `max_num_seqs`: 0.31.0
# (config/scheduler.py L70 `max_num_active_seqs: int | None = Field(default=None, ge=1)`, arg_utils.py
# L1689-1692; v1/core/sched/scheduler.py L127-131 sets `max_num_active_reqs` from it, else max_num_seqs,
# and L892-894 stops admitting at it). 0.30.0 has neither the field nor the flag (its scheduler.py L864
# stops at `max_num_running_reqs` = max_num_seqs), so its argument parser refuses the flag.
ACTIVE_SEQS_FROM = (0, 31)
# The first release that lowers a max_num_seqs left to its default to the token budget given:
# 0.10.1's engine/arg_utils.py L1709-1712 `min(default_max_num_seqs[usage_context],
# self.max_num_batched_tokens)` (0.33.0: L3232-3234, only when max_num_seqs was not given). Through
# 0.10.0 the default is taken as is (arg_utils.py L1652-1654; 0.9.2 L1696-1698), and config.py L2474-2478
# then refuses a token budget below it, as every release does when both are given.
SEQS_TO_TOKEN_BUDGET_FROM = (0, 10, 1)


def seqs_lowered_to_token_budget(version: str) -> bool:
    return version_tuple(version) >= SEQS_TO_TOKEN_BUDGET_FROM


# The first release whose default block size is 64 tokens: 0.34.0's config/cache.py L185
# `DEFAULT_BLOCK_SIZE = 64` (0.33.0 L185: 16), the start of every backend's preferred size
# (platforms/interface.py L783 update_block_size_for_backend, v1/attention/backend.py L158-166 unchanged):
# FlashAttention, Triton and FlashInfer take it as is, FlashInfer-MLA 64 for 32. Hybrid Mamba models align
# their attention block to it (platforms/interface.py L1080-1086, same code as 0.33.0).
BLOCK_SIZE_64_FROM = (0, 34)
# MLA on Hopper selects FLASHMLA, whose kernels take only 64-token blocks on every release
# (platforms/interface.py update_block_size_for_backend; FlashMLA's get_supported_kernel_block_sizes is
# [64]); the DSA indexer kernels are likewise fixed at 64 (seed 002). kvprobe assumes that backend for MLA.
MLA_BLOCK_SIZE = 64


def default_block_size(version: str, *, mla: bool = False) -> int:
    """The tokens per KV cache block `vllm serve` `version` takes when --block-size is not given (on a
    CUDA GPU, with the backend kvprobe assumes: FlashAttention, or FlashMLA for MLA)."""
    if mla:
        return MLA_BLOCK_SIZE
    return 64 if version_tuple(version) >= BLOCK_SIZE_64_FROM else 16  # CacheConfig.DEFAULT_BLOCK_SIZE


# The first release with the extensible KV cache (`--enable-extensible-kv-cache`, on by default on CUDA
# and ROCm): 0.34.0's config/cache.py L395 `enable_extensible_kv_cache: bool = Field(default=None)`,
# resolved in config/vllm.py L3180-3268 `_resolve_extensible_kv_cache` — on unless the platform is not
# CUDA-alike (L3201), `kv_cache_memory_bytes` (L3203) or `num_gpu_blocks_override` (L3208) is set, or a
# KV connector or elastic EP needs the old path. The profile run then only reserves (utilisation 1.0 unless
# given: config/cache.py L494-501 `resolved_gpu_memory_utilization`); the pool is measured after warm-up and
# CUDA-graph capture (v1/worker/extensible_kv_cache.py L592-708, v1/core/kv_cache_planning.py L1864-1906),
# which the ledger does not model (theory/vllm/unmodelled.py V16). 0.33.0 has neither field nor flag.
EXTENSIBLE_KV_CACHE_FROM = (0, 34)


def extensible_kv_cache(version: str, given: bool | None, *, kv_cache_memory_bytes: int | None,
                        num_gpu_blocks_override: int | None) -> bool:
    """Does `vllm serve` `version` on a CUDA GPU size its pool after warm-up (the extensible KV cache)?"""
    if version_tuple(version) < EXTENSIBLE_KV_CACHE_FROM:
        return False
    if given is not None:
        return given
    return kv_cache_memory_bytes is None and num_gpu_blocks_override is None


def extensible_kv_cache_refusal(version: str, given: bool | None) -> str | None:
    """What `vllm serve` before 0.34.0 says when given --[no-]enable-extensible-kv-cache, or None."""
    if given is None or version_tuple(version) >= EXTENSIBLE_KV_CACHE_FROM:
        return None
    flag = "--enable-extensible-kv-cache" if given else "--no-enable-extensible-kv-cache"
    return f"vLLM {version} has no {flag} (it came in 0.34.0): vllm: error: unrecognized arguments: {flag}"


# Window and chunked-local KV cache groups (a hybrid model's; release-changes.md V4, V5, V7):
# - the admission cap, 0.20.0 on: the full-sequence check charges a window group at most
#   `max_admission_blocks_per_request` (kv_cache_interface.py, 0.33.0 L918-944); through 0.19.1 it charges
#   cdiv(P, B), the whole prompt (single_type_kv_cache_manager.py L105 `get_num_blocks_to_allocate` in
#   0.18.1, no cap; 0.19.1's full-sequence gate calls it as is).
WINDOW_CAP_FROM = (0, 20)
# - the in-flight rule, 0.26.0 on: the cap and a request's most blocks count every batch in flight,
#   max_in_flight_tokens = 2T with async scheduling (config/vllm.py L524-533), and what left the window is
#   freed on the processed tokens, num_computed - num_in_flight (kv_cache_manager.py L443-445); through 0.25.1
#   both count T alone (kv_cache_interface.py SlidingWindowSpec.max_admission_blocks_per_request(T), 0.25.1;
#   max_memory_usage_bytes min(W - 1 + T, max_model_len), L262-270 in 0.18.1) and skipped blocks are freed
#   on num_computed (kv_cache_manager.py L404-407 in 0.25.1, L334-336 in 0.18.1).
WINDOW_IN_FLIGHT_FROM = (0, 26)
# - the capacity line, 0.20.1 on: int(max_concurrency x max_model_len); through 0.20.0 "GPU KV cache size"
#   is num_blocks // groups x the smallest block size (kv_cache_utils.py L1299-1303 in 0.18.1, L1694-1698 in
#   0.20.0; 0.20.1 L1699-1706).
KV_SIZE_LINE_FROM = (0, 20, 1)
# The block pool a hybrid model's groups share (what a preempted request finds of itself when it comes back):
# - a freed block without a hash goes to the head of the free queue, reused first: on 0.23.x a group's skipped
#   blocks (remove_skipped_blocks, single_type_kv_cache_manager.py L470-501) and a window group's freed request
#   (SlidingWindowManager.free, L752-764) only, a full or chunked group's request (the base free, L363-378)
#   and a Mamba state block (L1045) still to the tail; every free from 0.24.0 (block_pool.py free_blocks,
#   L615-640). Through 0.22.1 every freed block goes to the tail (append_n: block_pool.py L409-423 in 0.18.1,
#   L420 in 0.21.0, L431 in 0.22.1), so a preempted request's last hashed blocks are evicted first.
#   (tests/theory/matrix_real_vllm_hybrid_releases.py: 0.23.0's own scheduler, step by step.)
UNHASHED_FIRST_WINDOW_FROM = (0, 23)
UNHASHED_FIRST_FROM = (0, 24)
# - window and Mamba groups cache sparsely, only the checkpoints a later hit can use, from 0.29.0, whose
#   prefix_cache_retention_interval defaults to 0 (config/cache.py L60-66, L156; 0.33.0 L275); through
#   0.28.0 VLLM_PREFIX_CACHE_RETENTION_INTERVAL defaults to None, every full block cached (envs.py L1157-1161
#   in 0.28.0; 0.18.1's cache_blocks has no mask at all, single_type_kv_cache_manager.py L250-274). Dense, a
#   preempted request's window blocks stay hittable, and its admission charges them with the prompt's rest.
SPARSE_RETENTION_FROM = (0, 29)
# - a Gated DeltaNet layer in "align" mode takes a prefill checkpoint block beside its two state blocks, and
#   the attention block is grown to the FlashInfer GDN kernel's 64-token grid, from 0.33.0: its
#   QwenGatedDeltaNetAttention.get_kv_cache_spec sets `num_prefill_checkpoint_blocks=1` and the grid
#   (layers/mamba/gdn/qwen_gdn_linear_attn.py L739-750) and `_align_hybrid_block_size` puts the block on it
#   (platforms/interface.py L1089-1094). MambaSpec has the field from 0.29.0 (v1/kv_cache_interface.py L858;
#   `prefill_checkpoint_alignment` from 0.30.0, L1001), but through 0.32.0 only Kimi's KDA layers (and from
#   0.32.0 MambaMixer2, mamba_mixer2.py L1107) set it: the GDN layer has no spec of its own, the base Mamba
#   layer's leaves it 0 (layers/mamba/abstract.py L67-86 in 0.29.0, L65 in 0.31.0 and 0.32.0), and the block is
#   sized by the kernel alignment alone (platforms/interface.py L909-915 in 0.29.0, L921 in 0.30.0, L977 in
#   0.31.0, L1084-1088 in 0.32.0; 0.27.1 and 0.28.0 L901-907). Two state blocks a request through 0.32.0 (read in
#   each installed release's source: tests/shadow_env/test_vllm_gdn_checkpoints_source.py; the releases either
#   side run on the shadow, whose worker writes the layer's spec: expectations/diff/vllm-mamba-cache-mode-shadow.yaml).
MAMBA_CHECKPOINTS_FROM = (0, 33)
# - a Mamba hybrid's attention block is raised to a multiple of the kernel alignment whose page holds a Mamba
#   state; that alignment is max(16, the block size given or defaulted) from 0.20.2
#   (Platform._align_hybrid_block_size, platforms/interface.py L577 in 0.20.2, L861 in 0.25.1), a fixed 16
#   through 0.19.1 (models/config.py HybridAttentionMambaModelConfig L149 in 0.18.1, L218 in 0.19.1): with a
#   block of 128 given, Qwen3-Next's is 640 tokens on 0.20.2, 544 on 0.18.1 (its engine's own log, run on the
#   shadow, whose CPU platform gives 128). 0.20.0 and 0.20.1 are not read: 0.20.2's rule.
ALIGN_ON_GIVEN_BLOCK_FROM = (0, 20)


@dataclass(frozen=True)
class WindowRules:
    """How a release treats window / chunked-local groups and the block pool a hybrid model's groups
    share (see WINDOW_CAP_FROM, WINDOW_IN_FLIGHT_FROM, UNHASHED_FIRST_FROM, SPARSE_RETENTION_FROM)."""

    admission_cap: bool = True  # the full-sequence check caps a window group's charge
    in_flight: bool = True  # async's second batch counts, and window blocks are freed on processed tokens
    free_order: str = SPLIT  # which frees reuse blocks without a hash first (hybrid/block_pool.py)
    sparse_retention: bool = True  # window and Mamba groups keep only the checkpoints a hit can use
    mamba_checkpoints: bool = True  # a GDN layer's prefill checkpoint block and 64-token grid ("align" mode)
    align_on_given_block: bool = True  # a Mamba hybrid's block is a multiple of max(16, the block size given)

    def admission_text(self) -> str:
        return (f"window groups capped in the full-sequence check (from {_v(WINDOW_CAP_FROM)})" if self.admission_cap
                else f"the full-sequence check charges window groups the whole prompt (before {_v(WINDOW_CAP_FROM)})")

    def pool_text(self) -> str:
        free = {SPLIT: f"freed blocks without a hash reused first (from {_v(UNHASHED_FIRST_FROM)})",
                WINDOW_SPLIT: f"a window group's freed blocks without a hash reused first, the rest to the free "
                              f"queue's tail ({'.'.join(map(str, UNHASHED_FIRST_WINDOW_FROM))}.x)",
                TAIL: f"every freed block to the free queue's tail (before {_v(UNHASHED_FIRST_WINDOW_FROM)})"}[
            self.free_order]
        keep = (f"window and Mamba groups cache sparsely (from {_v(SPARSE_RETENTION_FROM)})" if self.sparse_retention
                else f"every full block of every group cached (before {_v(SPARSE_RETENTION_FROM)})")
        return f"{free}; {keep}"

    def checkpoint_text(self) -> str:
        return (f"in 'align' mode a Gated DeltaNet request holds a prefill checkpoint block beside its two state "
                f"blocks, the block on a 64-token grid (from {_v(MAMBA_CHECKPOINTS_FROM)})" if self.mamba_checkpoints
                else f"a Gated DeltaNet request holds two state blocks, no checkpoint block nor grid (before "
                     f"{_v(MAMBA_CHECKPOINTS_FROM)})")

    def in_flight_text(self) -> str:
        return (f"W-1+2T with async scheduling, freed on processed tokens (from {_v(WINDOW_IN_FLIGHT_FROM)})"
                if self.in_flight else f"W-1+T, freed on scheduled tokens (before {_v(WINDOW_IN_FLIGHT_FROM)})")


def window_rules(version: str) -> WindowRules:
    v = version_tuple(version)
    return WindowRules(admission_cap=v >= WINDOW_CAP_FROM, in_flight=v >= WINDOW_IN_FLIGHT_FROM,
                       free_order=SPLIT if v >= UNHASHED_FIRST_FROM else
                       WINDOW_SPLIT if v >= UNHASHED_FIRST_WINDOW_FROM else TAIL,
                       sparse_retention=v >= SPARSE_RETENTION_FROM, mamba_checkpoints=v >= MAMBA_CHECKPOINTS_FROM,
                       align_on_given_block=v >= ALIGN_ON_GIVEN_BLOCK_FROM)


def legacy_kv_size_line(version: str) -> bool:
    """Does this release print "GPU KV cache size" as num_blocks // groups x the smallest block size?"""
    return version_tuple(version) < KV_SIZE_LINE_FROM


def _v(release: tuple) -> str:
    return ".".join(map(str, release)) + (".0" if len(release) == 2 else "")


ACTIVE_SEQS_RULE = (f"--max-num-active-seqs caps RUNNING below max_num_seqs from vLLM "
                    f"{'.'.join(map(str, ACTIVE_SEQS_FROM))}.0 (v1/core/sched/scheduler.py max_num_active_reqs)")


def policy(version: str, *, reserve_full_isl: bool = True) -> str:
    """The admission policy (schedsim's name) of a vLLM version. Before 0.19.0 a prompt is admitted
    by its first chunk; from 0.19.0 the whole prompt must fit before it is admitted
    (`scheduler_reserve_full_isl`, on by default; off, a release admits as 0.11 does)."""
    return "vllm-0.11" if version_tuple(version) < FULL_PROMPT_FROM or not reserve_full_isl else "vllm-0.33"


# The first release with `--kv-cache-memory-bytes` (a KV pool of that many bytes, no profile): 0.10.2
# (config/cache.py L116, engine/arg_utils.py L344 and L744-745; v1/worker/gpu_worker.py L235-253 takes
# it before profiling). 0.10.1.1 and older have neither the field nor the flag.
KV_CACHE_MEMORY_BYTES_FROM = (0, 10, 2)


# Through 0.26.0 VllmConfig asserts that in Mamba "align" mode the block (after the hybrid alignment) fits one
# step's token budget (config/vllm.py L2265-2271 in 0.26.0, L2186-2192 in 0.25.1, L1684-1690 in 0.18.1): Qwen3-Next's
# 544-token block refuses to start under --max-num-batched-tokens 512 (both engines, on the shadow). 0.27.1 keeps
# only the chunked-MM assert there (L2303-2309), as 0.27.0 does (L2304-2310: read in its wheel).
MAMBA_ALIGN_BLOCK_UNCHECKED_FROM = (0, 27)


def mamba_align_block_refusal(version: str, *, align_mode: bool, block_size: int,
                              max_num_batched_tokens: int) -> str | None:
    """The engine's start-up assertion, in its words, when `version` refuses this Mamba "align" block."""
    if not align_mode or version_tuple(version) >= MAMBA_ALIGN_BLOCK_UNCHECKED_FROM or \
            block_size <= max_num_batched_tokens:
        return None
    return (f"In Mamba cache align mode, block_size ({block_size}) must be <= max_num_batched_tokens "
            f"({max_num_batched_tokens}). (vLLM {version}'s config/vllm.py asserts it at start-up; no release from "
            f"{_v(MAMBA_ALIGN_BLOCK_UNCHECKED_FROM)} checks it)")


def watermark_refusal(version: str, watermark: float) -> str | None:
    """What `vllm serve` of a release before 0.24.0 says when given `--watermark`, or None."""
    if not watermark or version_tuple(version) >= WATERMARK_FROM:
        return None
    return (f"vLLM {version} has no --watermark (it came in 0.24.0): vllm: error: unrecognized "
            f"arguments: --watermark {watermark:g}")


def kv_cache_memory_refusal(version: str, kv_cache_memory_bytes: int | None) -> str | None:
    """What `vllm serve` of a release before 0.10.2 says when given `--kv-cache-memory-bytes`, or None."""
    if kv_cache_memory_bytes is None or version_tuple(version) >= KV_CACHE_MEMORY_BYTES_FROM:
        return None
    return (f"vLLM {version} has no --kv-cache-memory-bytes (it came in 0.10.2): vllm: error: unrecognized "
            f"arguments: --kv-cache-memory-bytes {kv_cache_memory_bytes}")


def active_seqs_refusal(version: str, max_num_seqs: int, max_num_active_seqs: int | None) -> str | None:
    """Why this release does not start with `--max-num-active-seqs` (None: it starts, or the flag is not
    given): before 0.31.0 the flag does not exist; from it, a cap above max_num_seqs is refused
    (config/scheduler.py L336-343 in 0.31.0, the engine's message)."""
    if max_num_active_seqs is None:
        return None
    if version_tuple(version) < ACTIVE_SEQS_FROM:
        since = ".".join(map(str, ACTIVE_SEQS_FROM))
        return (f"vLLM {version} has no --max-num-active-seqs (first in {since}.0: config/scheduler.py "
                f"max_num_active_seqs); its argument parser refuses the flag at start-up")
    if max_num_active_seqs > max_num_seqs:
        return (f"max_num_active_seqs ({max_num_active_seqs}) cannot be greater than max_num_seqs "
                f"({max_num_seqs}).")
    return None


def running_cap(max_num_seqs: int, max_num_active_seqs: int | None) -> int:
    """The most requests RUNNING at once (scheduler.py `max_num_active_reqs`, 0.31.0 L127-131): the
    active cap when given (a release that has it; `active_seqs_refusal` first), else max_num_seqs."""
    return max_num_seqs if max_num_active_seqs is None else min(max_num_seqs, max_num_active_seqs)


def vllm_default_gpu_memory_utilization(version: str | None = None, *, extensible: bool = False) -> float:
    """`config/cache.py`'s default: 0.9 up to 0.19.1, 0.92 from 0.20.0 (memory_profile.RULES names the lines);
    1.0 with 0.34.0's extensible KV cache (`resolved_gpu_memory_utilization`, L494-501)."""
    return 1.0 if extensible else profile_rules(version or VLLM_DEFAULT_VERSION).gpu_memory_utilization


# What each policy's rule says, in the words a diff between two releases names it with (`kvprobe diff`).
RULES = {"vllm-0.11": "a prompt is admitted when its first chunk fits, before 0.19",
         "vllm-0.33": "whole prompt must fit from 0.19 (scheduler_reserve_full_isl on by default)"}
