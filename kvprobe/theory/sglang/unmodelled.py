"""SGLang's release changes kvprobe has no model for: one row each, with the release, the side of it
kvprobe does not model, the engine file and line, and when a configuration reaches the change
(`kvprobe.theory.unmodelled` says how the ledger uses them; docs/ledger.md has all 25 entries).

Read in the released wheels (`sglang/srt/...`) of 0.5.9-0.5.14, 0.5.16, 0.5.17, 0.5.21 and 0.5.22.
Hybrid (sliding-window, Mamba) pools before 0.5.20 are refused by the budget itself
(`kvprobe.theory.sglang.budget.sglang_budget`), so the hybrid entries (S4, S6, S7) need no row.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvprobe.theory.model.sizes import cdiv
from kvprobe.theory.sglang.memory_profile import release_key
from kvprobe.theory.unmodelled import Unmodelled, applying

ENGINE = "SGLang"
# resolve_max_num_reqs' estimate bounds (0.5.13 model_runner_kv_cache_mixin.py L880-881)
_ESTIMATE_MIN, _ESTIMATE_MAX = 2048, 4096


@dataclass(frozen=True)
class SglangFacts:
    """What an SGLang row's trigger looks at: the version and the ledger's inputs as it resolved them."""

    version: str
    max_total_num_tokens: int = 0
    context_len: int = 0
    page_size: int = 1
    dp: int = 1
    max_running_requests: int | None = None  # --max-running-requests as given
    prompt_tokens: int | None = None
    output_tokens: int | None = None


def _running_cap_differs(f: SglangFacts) -> bool:
    """The given --max-running-requests comes out otherwise than 0.5.14's min(value, M // 2)."""
    if f.max_running_requests is None or f.max_total_num_tokens <= 0 or f.context_len <= 0:
        return False
    asked = f.max_running_requests // f.dp
    modelled = min(asked, f.max_total_num_tokens // 2)
    if release_key(f.version) < (0, 5, 10, 0):
        return asked != modelled  # used as given
    estimate = max(min(int(f.max_total_num_tokens / f.context_len * 512), _ESTIMATE_MAX), _ESTIMATE_MIN)
    return min(asked, estimate) != modelled


def _output_past_memory_clamp(f: SglangFacts) -> bool:
    """O beyond max_new_tokens_for_memory, M - ceil_page(P) - page - 1 (which kvprobe clips to)."""
    if f.prompt_tokens is None or f.output_tokens is None or f.page_size <= 1:
        return False
    pages = cdiv(f.prompt_tokens, f.page_size) * f.page_size
    return f.output_tokens > f.max_total_num_tokens - pages - f.page_size - 1


ROWS: tuple[Unmodelled, ...] = (
    Unmodelled(
        "S5", ENGINE, "0.5.14", "before", "admission",
        "--max-running-requests was used as given (up to 0.5.9) or clamped to the estimate "
        "clamp(M / context_len x 512, 2048, 4096) (0.5.10-0.5.13), not to M // 2 as kvprobe does; here that "
        "changes max_running_requests",
        ("0.5.13 model_executor/model_runner_kv_cache_mixin.py L876-887 _resolve_max_num_reqs: min(value // dp, "
         "estimated)",
         "0.5.14 model_executor/model_runner_kv_cache_mixin.py L981-994: min(value // dp, token_capacity // 2)",
         "0.5.9 model_executor/model_runner.py L593-600: min(value // dp, req_to_token_pool.size), the pool "
         "sized to the value itself (model_runner_kv_cache_mixin.py L339-340 init_memory_pool): used as given",
         "0.5.10 model_executor/model_runner_kv_cache_mixin.py L840-851 _resolve_max_num_reqs: first with "
         "min(value // dp, estimated), as release-changes.md S5 says"),
        _running_cap_differs),
    Unmodelled(
        "S8", ENGINE, "0.5.21", "before", "admission",
        "max_new_tokens was not clipped to the memory (max_new_tokens_for_memory, M - ceil_page(P) - page - 1) "
        "as kvprobe clips it; this request's output passes that bound",
        ("0.5.21 managers/scheduler.py L2545 init_req_max_new_tokens -> "
         "mem_cache/allocator/base.py L79 max_new_tokens_for_memory",
         "0.5.17 managers/scheduler.py L2110 init_req_max_new_tokens: no such clip"),
        _output_past_memory_clamp),
)


def unmodelled(facts: SglangFacts) -> list[Unmodelled]:
    """The rows this version and these inputs reach."""
    return applying(ROWS, facts, release_key)
