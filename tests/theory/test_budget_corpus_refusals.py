"""The corpus's vLLM logs the ledger checks without a pool to compare: a refusal at start-up, before any
pool is sized (vLLM's free-memory check on a shared card), a refusal when sizing it (a pool too small for
one request, or none), and the token line 0.29.0 prints for a sliding + full model (test_budget_corpus.py
holds the cases and the ledger's command line for each)."""

from __future__ import annotations

import re

from test_budget_corpus import (
    CASES,
    FREE_AT_START,
    REFUSED_AT_SIZING,
    REFUSED_AT_START,
    REFUSED_SIZING,
    compare,
    run_ledger,
    why_not_runnable,
)

# Refusals the ledger does not predict, with the reason.
UNPREDICTED_REFUSALS = {
    "vllm-0.19.0-h100-gpt-oss-20b-oom": "CUDA OOM in the sampler warm-up after the KV pool was allocated "
                                        "(gpu_model_runner.py _dummy_sampler_run in compile_or_warm_up_model): "
                                        "the ledger sizes the pool, it does not model memory after it",
    "vllm-0.17.1-rtx3090-llama31-8b-sampler-oom": "the same OOM in the sampler warm-up, after the pool, on a card "
                                                  "other processes held memory of (0.17.1 sizes the pool from the "
                                                  "total, not the free memory)",
    "vllm-0.19.0-h100-gpt-oss-20b-tp2-gmu095-sampler-oom": "the same OOM in the sampler warm-up, after the pool, on "
                                                           "both TP 2 workers at utilisation 0.95",
}
# Engines that started where the ledger predicts a refusal, with the reason (none today).
REFUSALS_NOT_SEEN: dict[str, str] = {}


def test_refusals_of_the_compared_cases():
    """Every compared case: the ledger refuses exactly where the engine did, but the named exceptions."""
    for stem, case in CASES.items():
        if why_not_runnable(case) is not None:
            continue
        ours, refused = compare(stem, case)["refused"], bool(case["logged"].get("refused"))
        if refused and stem in UNPREDICTED_REFUSALS:
            assert not ours, f"{stem}: now predicted: strike it off UNPREDICTED_REFUSALS"
        elif not refused and stem in REFUSALS_NOT_SEEN:
            assert ours, f"{stem}: the ledger no longer refuses: strike it off REFUSALS_NOT_SEEN"
        else:
            assert ours == refused, stem


# The start-up refusals the corpus holds (a case refused this way that is not listed here fails the test below).
REFUSED_BEFORE_ANY_POOL = [
    "vllm-0.19.0-h100-codellama-34b-tp2-refused",
    "vllm-0.19.0-h100-llama4-scout-tp4-refused",
]


def test_refusals_before_any_pool_are_predicted():
    """vLLM 0.19.0 on H100s another process held memory of: `Free memory on device cuda:1 (60.87/79.19 GiB)
    on startup is less than desired GPU memory utilization (0.95, 75.23 GiB)` (CodeLlama-34B at TP 2; 60.33 GiB
    for Llama-4-Scout at TP 4) (v1/worker/utils.py request_memory: free at the init snapshot < ceil(total x
    util)). The ledger, given that free figure, refuses each with the same numbers."""
    stems = [s for s, case in CASES.items() if why_not_runnable(case) == REFUSED_AT_START]
    assert stems == REFUSED_BEFORE_ANY_POOL
    for stem in stems:
        logged = CASES[stem]["logged"]["refused"]
        refusal = run_ledger(CASES[stem]).refusal
        assert refusal is not None and refusal.startswith("ValueError: Free memory on device"), refusal
        assert FREE_AT_START.search(logged)  # the ledger knows no device name: it prints none
        numbers = re.compile(r"\(([\d.]+)/([\d.]+) GiB\).*\(([\d.]+), ([\d.]+) GiB\)")
        assert numbers.search(refusal).groups() == numbers.search(logged).groups(), (refusal, logged)


# A refusal when sizing that the ledger does not predict: the same configuration started on another start.
SIZED_BETWEEN_STARTS = {
    "vllm-0.17.1-rtx3090-qwen25-7b-gmu065-refused": (
        "vllm-0.17.1-rtx3090-qwen25-7b-gmu065",
        "Qwen2.5-7B at 0.65 started with 0.49 GiB and refused 3.5 minutes later with 0.41 (0.44 needed): the "
        "host's pool moves by 0.08 GiB between starts, more than the 0.03 GiB between the ledger's 0.47 and "
        "what one request needs; the ledger starts it, as the first start did"),
}


def test_refusals_when_sizing_the_pool_are_predicted():
    """vLLM 0.17.1 on an RTX 3090 (max_model_len 8192): Llama-3.1-8B at 0.70 (0.95 GiB for the 1.0 GiB one request
    needs) and Qwen2.5-7B at 0.60 (-0.7 GiB: no cache blocks). The ledger refuses each the same way (its pools:
    0.96, -0.71 GiB), with the same figure needed for one request. Qwen2.5-7B at 0.65, refused on one start and
    started on another, is sized between the two (SIZED_BETWEEN_STARTS)."""
    stems = [s for s, case in CASES.items() if why_not_runnable(case) == REFUSED_AT_SIZING]
    assert len(stems) == 3, stems
    needed = re.compile(r"\(([\d.]+) GiB KV cache is needed")
    for stem, (started, _) in SIZED_BETWEEN_STARTS.items():
        ledger = run_ledger(CASES[stem])
        assert ledger.refusal is None, f"{stem}: refused again: strike it off SIZED_BETWEEN_STARTS"
        logged = CASES[stem]["logged"]["refused"]
        refused_with = float(re.search(r"available KV cache memory \(([\d.]+) GiB\)", logged)[1])
        pool = ledger.budget.kv_pool_bytes / 2**30
        assert refused_with < pool < CASES[started]["logged"]["kv_cache_gib"], (pool, refused_with)
    for stem in (s for s in stems if s not in SIZED_BETWEEN_STARTS):
        logged = CASES[stem]["logged"]["refused"]
        refusal = run_ledger(CASES[stem]).refusal
        assert refusal is not None, stem
        assert REFUSED_SIZING.search(f"ValueError: {refusal}").group(1) == REFUSED_SIZING.search(logged).group(1)
        if needed.search(logged):
            assert needed.search(refusal).group(1) == needed.search(logged).group(1), (stem, refusal)


def test_the_token_line_of_0290_is_group_aware():
    """0.29.0's `GPU KV cache size` of a sliding + full model: num_blocks / (full blocks + sliding blocks) per
    max-length request x max_model_len (kv_cache_utils.py L1047-1069, L2011-2021), the sliding group holding
    cdiv(W - 1 + 2 x max_num_batched_tokens, block) + 1 with async scheduling (kv_cache_interface.py L704-731)."""
    b = run_ledger(CASES["vllm-0.29.0-l4-gpt-oss-20b"]).budget
    per_request = 32768 // 16 + (-(-(127 + 2 * 4096) // 16) + 1)
    assert per_request == 2048 + 521
    assert b.kv_tokens == int(b.num_blocks / per_request * 32768)
