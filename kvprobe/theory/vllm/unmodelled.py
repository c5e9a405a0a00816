"""vLLM's release changes kvprobe has no model for: one row each, with the release, the side of it
kvprobe does not model, the engine file and line, and when a configuration reaches the change
(`kvprobe.theory.unmodelled` says how the ledger uses them; docs/ledger.md has all 26 entries; V16 is not
in release-changes.md). The window groups' rules of V4 and V5 and the capacity line of V7 are modelled
(theory/vllm/releases.py WindowRules, KV_SIZE_LINE_FROM).

Read in the released wheels (`vllm/...`): a row's first release was found by reading the same
function in every release from 0.18.1 to 0.33.0 (and 0.12.0-0.14.0 for V14), and its sources cite the
release before and the first release; a first release that differs from release-changes.md's is said
so there, and a row that took its release from release-changes.md says that.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvprobe.releases import version_tuple
from kvprobe.theory.model.layers import LINEAR
from kvprobe.theory.model.sizes import GIB
from kvprobe.theory.unmodelled import Unmodelled, applying

ENGINE = "vLLM"


@dataclass(frozen=True)
class VllmFacts:
    """What a vLLM row's trigger looks at: the version and the ledger's inputs as it resolved them."""

    version: str
    kinds: tuple[str, ...] = ()  # one layer kind per decoder layer (kvprobe.theory.model.layers)
    max_model_len_auto: bool = False  # --max-model-len auto / -1
    max_num_seqs: int = 256
    max_num_batched_tokens_given: bool = False
    gpu_memory_bytes: int | None = None
    prefix_caching: bool = True
    num_blocks: int = 0  # the pool as logged (null block included)
    num_gpu_blocks_override: int | None = None
    refused: bool = False  # the ledger's startup check refuses this configuration
    # 0.34.0's extensible KV cache sizes a profiled pool after warm-up (the budget's "reservation")
    pool_after_warmup: bool = False

    def has(self, kind: str) -> bool:
        return kind in self.kinds


def _mamba_seqs_over_blocks(f: VllmFacts) -> bool:
    return f.has(LINEAR) and f.num_blocks > 0 and f.max_num_seqs > f.num_blocks


def _override_decides_start(f: VllmFacts) -> bool:
    """An override whose blocks the ledger auto-fits to or refuses by (a fitting one starts either way)."""
    return f.num_gpu_blocks_override is not None and (f.max_model_len_auto or f.refused)


def _large_gpu_default_budget(f: VllmFacts) -> bool:
    return not f.max_num_batched_tokens_given and (f.gpu_memory_bytes or 0) >= 160 * GIB


def _auto_len(f: VllmFacts) -> bool:
    return f.max_model_len_auto


def _pool_after_warmup(f: VllmFacts) -> bool:
    return f.pool_after_warmup


# Layer kinds whose vLLM model classes are SupportsMambaPrefixCaching, so that 0.18.1-0.27.1 resolve "all" for
# them (V15): none of kvprobe's. Its linear layers are Gated DeltaNet (Qwen3-Next; theory/model/layers.py refuses
# Mamba-state configs), and Qwen3NextForCausalLM is not one (qwen3_next.py L767-775 in 0.27.1, L1549-1556 in
# 0.18.1): those releases resolve "align" for it, as 0.28.0 does.
ALL_MODE_KINDS: frozenset[str] = frozenset()


def _mamba_all_mode(f: VllmFacts) -> bool:
    return f.prefix_caching and any(f.has(kind) for kind in ALL_MODE_KINDS)


ROWS: tuple[Unmodelled, ...] = (
    Unmodelled(
        "V3", ENGINE, "0.20.0", "since", "startup",
        "a hybrid Mamba model with max_num_seqs above the pool's blocks is refused at startup "
        "(\"max_num_seqs (N) exceeds available Mamba cache blocks (M)\", FULL cuda graphs on) and the ledger "
        "does not refuse it",
        ("config/compilation.py resolve_cudagraph_mode_and_sizes (release-changes.md names it "
         "_check_and_update_cudagraph_mode), 0.20.0 L1427-1442 (0.33.0 L1517-1532): raises when "
         "kv_cache_config.has_mamba_layers and max_num_reqs > kv_cache_config.num_blocks",
         "0.19.1 config/compilation.py L1285 adjust_cudagraph_sizes_for_mamba_cache: capped instead, no such "
         "raise (0.18.1 L1198 the same); first in 0.20.0, as release-changes.md V3 says"),
        _mamba_seqs_over_blocks),
    Unmodelled(
        "V7", ENGINE, "0.20.1", "before", "startup",
        "--num-gpu-blocks-override did not feed the one-request check and auto-fit (they used the profiled "
        "memory); the ledger auto-fits to or refuses by the override's blocks",
        ("0.20.0 v1/core/kv_cache_utils.py L893-909 may_override_num_blocks: the override replaces num_blocks "
         "only after get_kv_cache_configs' auto-fit and check (L1989-2002), which use the profiled memory",
         "0.20.1 v1/core/kv_cache_utils.py L1982-2002 get_kv_cache_configs: available_memory = override x "
         "_pool_bytes_per_block (L903) before auto-fit and the check (0.33.0 v1/core/kv_cache_planning.py "
         "L1510-1531, L251 _pool_bytes_per_block)",
         "first in 0.20.1, not 0.21.0 as release-changes.md V7 says"),
        _override_decides_start),
    Unmodelled(
        "V10", ENGINE, "0.28.0", "before", "pool",
        "a GPU of 160 GiB or more got the 70 GiB tier's max_num_batched_tokens 8192, not 16384 (the ledger "
        "takes 0.28.0's tiers: activation peak and chunking differ); give --max-num-batched-tokens",
        ("0.27.1 engine/arg_utils.py L2544-2553 get_batch_defaults: >= 70 GiB and not A100: 8192 / 1024, no "
         "higher tier (0.18.1 L2008-2016 the same)",
         "0.28.0 engine/arg_utils.py L2582-2591 get_batch_defaults: >= 160 GiB 16384 / 1024 (0.33.0 L2973-2990); "
         "first in 0.28.0, as release-changes.md V10 says (PR #51726)"),
        _large_gpu_default_budget),
    Unmodelled(
        "V14", ENGINE, "0.14.0", "before", "startup",
        "--max-model-len auto does not exist (the engine refuses the value); the ledger auto-fits",
        ("0.13.0 engine/arg_utils.py L300-307: --max-model-len parsed by human_readable_int (L2026, no 'auto'); "
         "v1/core/kv_cache_utils.py has no auto-fit",
         "0.14.0 engine/arg_utils.py L300-302 human_readable_int_or_auto (L2121-2135: 'auto' / -1 -> -1); "
         "v1/core/kv_cache_utils.py L1389 _auto_fit_max_model_len, called L1508-1509 (0.33.0 "
         "v1/core/kv_cache_planning.py L1337); first in 0.14.0, as release-changes.md V14 says"),
        _auto_len),
    Unmodelled(
        "V15", ENGINE, "0.28.0", "before", "pool",
        "with prefix caching a Mamba hybrid model whose vLLM class supports Mamba prefix caching resolved "
        "mamba_cache_mode 'all' (0.28.0 on: always 'align', which kvprobe models; Qwen3-Next's Gated DeltaNet "
        "resolved 'align' before 0.28.0 too)",
        ("0.27.1 model_executor/models/config.py L614-617 MambaModelConfig.verify_and_update_config: 'all' if "
         "supports_mamba_prefix_caching else 'align' (0.18.1 L368-371, every release 0.19.0-0.27.1 the same; "
         "0.20.0-0.21.0 L352-362 'align' only with speculative decoding)",
         "0.28.0 model_executor/models/config.py L603-604: 'align' (0.33.0 L764-765); first in 0.28.0, not "
         "0.33.0 as taken from release-changes.md V15 (which names no first release for it)",
         # the trigger reads layer kinds only, and kvprobe's linear layers are all Gated DeltaNet
         "'all' reaches only classes that are SupportsMambaPrefixCaching (0.27.1: mamba.py, mamba2.py, jamba.py, "
         "nemotron_h.py, zamba2.py L807, falcon_h1.py L502, granitemoehybrid.py L583), none of which kvprobe "
         "reads; Qwen3NextForCausalLM is not (0.27.1 qwen3_next.py L767-775, 0.18.1 L1549-1556) and resolves "
         "'align' on both sides, run on 0.27.1's and 0.28.0's engines by "
         "expectations/diff/vllm-mamba-cache-mode-shadow.yaml"),
        _mamba_all_mode),
    # Not in release-changes.md (it lists changes to 0.33.0): found in the 0.34.0 wheel against 0.33.0's.
    Unmodelled(
        "V16", ENGINE, "0.34.0", "since", "pool",
        "the extensible KV cache (on by default on a CUDA GPU): the profile run only reserves (utilisation 1.0 "
        "unless given), and the pool is measured after warm-up and CUDA-graph capture — the free memory then, "
        "less max(1 GiB, 0.75 x the activation peak) and the larger of that peak and torch's reserve growth, "
        "which no configuration gives; give --num-gpu-blocks-override or --kv-cache-memory-bytes, or "
        "--no-enable-extensible-kv-cache for the profiled pool of 0.33.0's rules",
        ("0.34.0 config/cache.py L395 enable_extensible_kv_cache, config/vllm.py L3180-3268 "
         "_resolve_extensible_kv_cache (on unless not CUDA-alike, kv_cache_memory_bytes or "
         "num_gpu_blocks_override set, or a KV connector needs the old path)",
         "0.34.0 v1/worker/extensible_kv_cache.py L592-618 measure_kv_cache_bytes (margin L64-65: 1 GiB floor), "
         "L621-708 measure_kv_cache_blocks; v1/core/kv_cache_planning.py L1864-1906 finalize_extensible_kv_cache "
         "(num_blocks = min(measured, reserved)); v1/worker/gpu/model_runner.py L1121-1125: no graph estimate",
         "0.33.0 has no such path (config/cache.py L215 gpu_memory_utilization = 0.92, the pool from "
         "determine_available_memory)"),
        _pool_after_warmup),
)


def unmodelled(facts: VllmFacts) -> list[Unmodelled]:
    """The rows this version and these inputs reach."""
    return applying(ROWS, facts, version_tuple)


def first_release(entry: str) -> str:
    """The release the table gives for `entry` (V4, V7, ...): where a rule the ledger applies begins."""
    return next(row.release for row in ROWS if row.entry == entry)
