"""SGLang's hybrid sliding-window pools as the ledger shows them: the pools' names, and what one
request costs in each (stepped through the SWA scheduler alone, radix cache off or on)."""

from __future__ import annotations

import dataclasses

from kvprobe.theory.model.sizes import cdiv
from kvprobe.theory.sglang.schedule_policy import CLIP_MAX_NEW_TOKENS
from kvprobe.theory.sglang.swa.radix import SglangSwaRadixScheduler
from kvprobe.theory.sglang.swa.scheduler import SglangSwaScheduler
from kvprobe.theory.sim.core import SglangConfig, SimRequest

FULL_POOL = "full pool"


def window_pool_label(window: int) -> str:
    """The window pool as the ledger names it: SGLang's window (gpt-oss: sliding_window - 1)."""
    return f"swa pool (window {window})"


def request_pool_tokens(cfg: SglangConfig, P: int, O: int, layers: tuple[int, int] = (0, 0)) -> list[dict]:  # noqa: N803, E741
    """What one request of P prompt and O output tokens (ignore_eos) costs in each pool: the tokens
    admission charges it (full: P + min(O, 4096) + a page, check_prefill; window: the
    estimate_swa_kv_tokens charge), and the slots it holds at its peak and on average over its
    life (the radix cache on: used, i.e. not evictable), stepped through this scheduler alone in pools
    large enough for it. Keys as vLLM's groups
    (kvprobe.theory.vllm.hybrid.groups.GroupBlocks), in tokens; `layers`: the pools' model layers (full, window)."""
    big = 4 * (P + O) + 4 * cfg.page_size
    solo = (SglangSwaScheduler if cfg.disable_radix_cache else SglangSwaRadixScheduler)(
        dataclasses.replace(cfg, max_total_num_tokens=big, swa_pool_tokens=big,
                            max_running_requests=1, context_len=max(cfg.context_len, big)))
    solo.add(SimRequest("solo", list(range(1, P + 1)), O))
    full, window = [], []
    while solo.has_work():
        solo.step()
        full.append(solo.pool.used)
        window.append(solo.swa.used)
    max_new = min(O, CLIP_MAX_NEW_TOKENS)
    paged = cdiv(P, cfg.page_size) * cfg.page_size
    chunk = cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else None
    admit = (P + max_new + cfg.page_size, solo._swa_tokens(paged, max_new, chunk))
    out = []
    for label, kind, n, held, charge in ((FULL_POOL, "full", layers[0], full, admit[0]),
                                         (window_pool_label(cfg.sliding_window_size), "sliding", layers[1],
                                          window, admit[1])):
        out.append({"group": label, "kind": kind, "copies": 1, "layers": n, "blocks_admission": charge,
                    "blocks_peak": max(held), "blocks_mean": round(sum(held) / len(held), 2)})
    return out
