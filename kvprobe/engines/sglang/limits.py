"""SGLang's request limits (0.5.23): the longest input, the running cap, the tokenizer's and the
scheduler's refusals, the silent clipping of max_new_tokens. The arithmetic the theory owns is
read from the theory (`kvprobe/theory/sglang/budget.py`)."""

from __future__ import annotations

from kvprobe.engines.base import ReportedCapacity
from kvprobe.theory.sglang.budget import sglang_default_max_running_requests, sglang_max_req_input_len


def max_req_input_len(context_len: int, max_total_num_tokens: int) -> int:
    """managers/tp_worker.py L568-572: min(context_len - 1, M - 1) - 5 (theory owns it)."""
    return sglang_max_req_input_len(context_len, max_total_num_tokens)


def resolve_max_running_requests(max_total_num_tokens: int, context_len: int, user_value: int | None) -> int:
    """resolve_max_num_reqs (mem_cache/kv_cache_configurator.py); theory owns it."""
    return sglang_default_max_running_requests(max_total_num_tokens, context_len, user_value)


def check_tokenizer(prompt_len: int, max_new: int | None, min_new: int, context_len: int) -> str | None:
    """Tokenizer-side checks, in order (tokenizer_manager.py L1307-1378, sampling_params.py L280-294).
    A message means 400 before anything streams."""
    if prompt_len >= context_len:
        return f"The input ({prompt_len} tokens) is longer than the model's context length ({context_len} tokens)."
    if max_new is not None and prompt_len + max_new > context_len:
        return (f"Requested token count exceeds the model's maximum context length of {context_len} tokens. You "
                f"requested a total of {prompt_len + max_new} tokens: {prompt_len} tokens from the input messages "
                f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input messages "
                "or the completion to fit within the limit.")
    if max_new is not None and not 0 <= min_new <= max_new:
        return f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}."
    return None


def check_scheduler(prompt_len: int, max_req_input: int) -> str | None:
    """Scheduler-side check (managers/utils.py validate_input_length L259-289): an abort with status 400."""
    if prompt_len >= max_req_input:
        return (f"Input length ({prompt_len} tokens) exceeds the maximum allowed length ({max_req_input} tokens). "
                "Use a shorter input or enable --allow-auto-truncate.")
    return None


def clip_max_new(prompt_len: int, max_new: int, *, context_len: int, max_total_num_tokens: int,
                 page_size: int = 1) -> int:
    """Silent clipping (scheduler.py init_req_max_new_tokens L2693-2740, allocator max_new_tokens_for_memory)."""
    max_req_len = min(context_len - 1, max_total_num_tokens - 1)
    ceil_page = -(-prompt_len // page_size) * page_size
    return max(0, min(max_new, max_req_len - prompt_len - 1, max_total_num_tokens - ceil_page - page_size - 1))


def length_limit(reported: ReportedCapacity) -> tuple[int, int] | None:
    """(context_len, HTTP status of a request one token past it): the tokenizer manager refuses
    input + max_new_tokens > context_len with 400 (tokenizer_manager.py L1307–1378)."""
    return None if reported.max_model_len is None else (int(reported.max_model_len), 400)
