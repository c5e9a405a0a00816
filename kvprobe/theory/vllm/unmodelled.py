"""vLLM's release changes kvprobe has no model for: one row each, with the release, the side of it
kvprobe does not model, the engine file and line, and when a configuration reaches the change
(`kvprobe.theory.unmodelled` says how the ledger uses them; docs/ledger.md has all 25 entries).

Read in the released wheels of 0.18.1 and 0.33.0 (`vllm/...`); a first release taken from
release-changes.md where the wheels between were not read is said so in the row's sources.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvprobe.releases import version_tuple
from kvprobe.theory.model.layers import CHUNKED, LINEAR, SLIDING
from kvprobe.theory.model.sizes import GIB, cdiv
from kvprobe.theory.unmodelled import Unmodelled, applying

ENGINE = "vLLM"


@dataclass(frozen=True)
class VllmFacts:
    """What a vLLM row's trigger looks at: the version and the ledger's inputs as it resolved them."""

    version: str
    kinds: tuple[str, ...] = ()  # one layer kind per decoder layer (kvprobe.theory.model.layers)
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    block_size: int = 16
    max_model_len: int = 8192
    max_model_len_auto: bool = False  # --max-model-len auto / -1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_num_batched_tokens_given: bool = False
    gpu_memory_bytes: int | None = None
    async_scheduling: bool = True
    prefix_caching: bool = True
    num_blocks: int = 0  # the pool as logged (null block included)
    num_groups: int = 1  # KV cache groups of the plan
    num_gpu_blocks_override: int | None = None
    refused: bool = False  # the ledger's startup check refuses this configuration
    prompt_tokens: int | None = None

    def has(self, kind: str) -> bool:
        return kind in self.kinds

    def window(self) -> tuple[str, int] | None:
        """(kind, tokens) of the recycling layers' window or chunk, if the model has one."""
        if self.has(SLIDING) and self.sliding_window:
            return SLIDING, self.sliding_window
        if self.has(CHUNKED) and self.attention_chunk_size:
            return CHUNKED, self.attention_chunk_size
        return None


def _window_cap_blocks(f: VllmFacts, in_flight: int) -> int | None:
    """max_admission_blocks_per_request of the window/chunk groups (0.33.0 v1/kv_cache_interface.py
    L918-944 sliding, L864-881 chunked) with `in_flight` tokens."""
    w = f.window()
    if w is None:
        return None
    kind, size = w
    if kind == SLIDING:
        return cdiv(min(size - 1 + in_flight, f.max_model_len), f.block_size) + 1
    return cdiv(min(size + in_flight, f.max_model_len), f.block_size)


def _mamba_seqs_over_blocks(f: VllmFacts) -> bool:
    return f.has(LINEAR) and f.num_blocks > 0 and f.max_num_seqs > f.num_blocks


def _long_prompt_on_window(f: VllmFacts) -> bool:
    cap = _window_cap_blocks(f, f.max_num_batched_tokens)
    return cap is not None and f.prompt_tokens is not None and cdiv(f.prompt_tokens, f.block_size) > cap


def _async_window_long_len(f: VllmFacts) -> bool:
    w = f.window()
    return f.async_scheduling and w is not None and f.max_model_len > w[1] + f.max_num_batched_tokens


def _capacity_figure_differs(f: VllmFacts) -> bool:
    return f.num_groups > 1 or f.max_model_len % f.block_size != 0


def _override_decides_start(f: VllmFacts) -> bool:
    """An override whose blocks the ledger auto-fits to or refuses by (a fitting one starts either way)."""
    return f.num_gpu_blocks_override is not None and (f.max_model_len_auto or f.refused)


def _large_gpu_default_budget(f: VllmFacts) -> bool:
    return not f.max_num_batched_tokens_given and (f.gpu_memory_bytes or 0) >= 160 * GIB


def _auto_len(f: VllmFacts) -> bool:
    return f.max_model_len_auto


def _mamba_prefix_caching(f: VllmFacts) -> bool:
    return f.has(LINEAR) and f.prefix_caching


ROWS: tuple[Unmodelled, ...] = (
    Unmodelled(
        "V3", ENGINE, "0.20.0", "since", "startup",
        "a hybrid Mamba model with max_num_seqs above the pool's blocks is refused at startup "
        "(\"max_num_seqs (N) exceeds available Mamba cache blocks (M)\", FULL cuda graphs on) and the ledger "
        "does not refuse it",
        ("config/compilation.py _check_and_update_cudagraph_mode, 0.33.0 L1516-1532: raises when "
         "kv_cache_config.has_mamba_layers and max_num_reqs > kv_cache_config.num_blocks",
         "0.18.1 config/compilation.py L1198 adjust_cudagraph_sizes_for_mamba_cache: capped instead (first "
         "release with the refusal 0.20.0: release-changes.md V3, 0.19.x not read here)"),
        _mamba_seqs_over_blocks),
    Unmodelled(
        "V4", ENGINE, "0.20.0", "before", "admission",
        "a sliding-window / chunked-local group charged the whole prompt at admission (cdiv(P, B) blocks), "
        "not the startup cap kvprobe applies; this prompt is longer than that cap",
        ("0.18.1 v1/core/single_type_kv_cache_manager.py L105 get_num_blocks_to_allocate: cdiv(num_tokens, "
         "block_size), no cap",
         "0.33.0 v1/kv_cache_interface.py L918-944 max_admission_blocks_per_request (first in 0.20.0: "
         "release-changes.md V4, PR #40946)"),
        _long_prompt_on_window),
    Unmodelled(
        "V5", ENGINE, "0.26.0", "before", "admission",
        "the window/chunk cap was W-1+T (async scheduling's second batch in flight not reserved, blocks freed "
        "on the scheduled count); kvprobe applies 0.26.0's W-1+2T with async scheduling",
        ("0.33.0 config/vllm.py L601-610 max_in_flight_tokens = max_concurrent_batches x max_num_batched_tokens; "
         "v1/kv_cache_interface.py L918-944",
         "first in 0.26.0: release-changes.md V5, PR #47728 (0.19-0.25 not read here)"),
        _async_window_long_len),
    Unmodelled(
        "V7", ENGINE, "0.21.0", "before", "figure",
        "\"GPU KV cache size\" was num_blocks // groups x min block size; the pool (tokens) line is 0.21.0's "
        "max_concurrency x max_model_len (the blocks and the prediction are the same)",
        ("0.18.1 v1/core/kv_cache_utils.py L1299-1303",
         "0.33.0 v1/core/kv_cache_utils.py L1124-1128 (get_kv_cache_capacity)",
         "first in 0.21.0: release-changes.md V7"),
        _capacity_figure_differs),
    Unmodelled(
        "V7", ENGINE, "0.21.0", "before", "startup",
        "--num-gpu-blocks-override did not feed the one-request check and auto-fit (they used the profiled "
        "memory); the ledger auto-fits to or refuses by the override's blocks",
        ("0.33.0 v1/core/kv_cache_planning.py L251 _pool_bytes_per_block; first in 0.21.0: release-changes.md V7",),
        _override_decides_start),
    Unmodelled(
        "V10", ENGINE, "0.28.0", "before", "pool",
        "a GPU of 160 GiB or more got the 70 GiB tier's max_num_batched_tokens 8192, not 16384 (the ledger "
        "takes 0.28.0's tiers: activation peak and chunking differ); give --max-num-batched-tokens",
        ("0.18.1 engine/arg_utils.py L2008-2016 get_batch_defaults: >= 70 GiB and not A100: 8192 / 1024",
         "0.33.0 engine/arg_utils.py L2973-2990: >= 160 GiB 16384 (first in 0.28.0: release-changes.md V10, "
         "PR #51726)"),
        _large_gpu_default_budget),
    Unmodelled(
        "V14", ENGINE, "0.14.0", "before", "startup",
        "--max-model-len auto does not exist (the engine refuses the value); the ledger auto-fits",
        ("0.33.0 v1/core/kv_cache_planning.py L1337 _auto_fit_max_model_len (first in 0.14.0: "
         "release-changes.md V14)",),
        _auto_len),
    Unmodelled(
        "V15", ENGINE, "0.33.0", "before", "pool",
        "with prefix caching a Mamba hybrid model's mamba_cache_mode resolved to 'all' where the model "
        "supports it (0.33.0: always 'align', which kvprobe models)",
        ("0.18.1 model_executor/models/config.py L367-383: 'all' if supports_mamba_prefix_caching else 'align'",
         "0.33.0 model_executor/models/config.py L763-765: 'align'; releases 0.19-0.32 not read (V15: detail "
         "unconfirmed)"),
        _mamba_prefix_caching),
)


def unmodelled(facts: VllmFacts) -> list[Unmodelled]:
    """The rows this version and these inputs reach."""
    return applying(ROWS, facts, version_tuple)
