"""The batch sizes `vllm serve` settles before anything is sized: max_num_seqs and max_num_batched_tokens
from what was given, the GPU tier's defaults (engine/arg_utils.py get_batch_defaults) and each release's
rules for the rest (`kvprobe.theory.vllm.releases`). The ledger and the shadow target's launch flags both
take them from here."""

from __future__ import annotations

from kvprobe.errors import ConfigError
from kvprobe.releases import VLLM_DEFAULT_VERSION
from kvprobe.theory.model.sizes import GIB
from kvprobe.theory.vllm.releases import seqs_lowered_to_token_budget


def vllm_batch_defaults(gpu_memory_bytes: int | None, max_model_len: int, *,
                        gpu_name: str | None = None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of `vllm serve` 0.33.0 (arg_utils.get_batch_defaults).

    Tiers by device memory: >= 160 GiB -> 1024 / 16384; >= 70 GiB and not an A100 (H100/H200
    class) -> 1024 / 8192; everything else -> 256 / 2048. Without a GPU name a >= 70 GiB card is
    taken as H100/H200 class. Then the token budget is capped at max_num_seqs * max_model_len and
    max_num_seqs at the token budget (chunked prefill on).
    """
    mem = gpu_memory_bytes or 0
    a100 = bool(gpu_name) and "a100" in gpu_name.lower()
    if mem >= 160 * GIB:
        seqs, tokens = 1024, 16384
    elif mem >= 70 * GIB and not a100:
        seqs, tokens = 1024, 8192
    else:
        seqs, tokens = 256, 2048
    tokens = min(tokens, seqs * max_model_len)
    return min(seqs, tokens), tokens


def vllm_batch_sizes(gpu_memory_bytes: int | None, max_model_len: int, *, max_num_seqs: int | None = None,
                     max_num_batched_tokens: int | None = None, gpu_name: str | None = None,
                     version: str = VLLM_DEFAULT_VERSION) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) as `vllm serve` `version` settles them from what was given
    (None: not given): the GPU tier's defaults for the rest, a defaulted token budget capped at
    max_num_seqs x max_model_len, and a defaulted max_num_seqs lowered to the token budget from 0.10.1
    (`releases.SEQS_TO_TOKEN_BUDGET_FROM`). A token budget below max_num_seqs is then refused, as the
    engine's config/scheduler.py L329-334 (0.33.0) does."""
    seqs, tokens = vllm_batch_defaults(gpu_memory_bytes, max_model_len, gpu_name=gpu_name)
    seqs = max_num_seqs or seqs
    tokens = max_num_batched_tokens or min(tokens, seqs * max_model_len)
    if max_num_seqs is None and seqs_lowered_to_token_budget(version):
        seqs = min(seqs, tokens)
    if tokens < seqs:
        raise ConfigError(f"max_num_batched_tokens ({tokens}) must be greater than or equal to "
                          f"max_num_seqs ({seqs}).", key="max_num_batched_tokens")
    return seqs, tokens
