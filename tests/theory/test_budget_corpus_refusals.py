"""The corpus's vLLM logs the ledger checks without a pool to compare: a refusal at start-up, before any
pool is sized (vLLM's free-memory check on a shared card), and the token line 0.29.0 prints for a
sliding + full model (test_budget_corpus.py holds the cases and the ledger's command line for each)."""

from __future__ import annotations

import re

from test_budget_corpus import CASES, FREE_AT_START, REFUSED_AT_START, run_ledger, why_not_runnable


def test_refusals_before_any_pool_are_predicted():
    """vLLM 0.19.0 on an H100 another process held 18 GiB of: `Free memory on device cuda:1 (60.87/79.19 GiB)
    on startup is less than desired GPU memory utilization (0.95, 75.23 GiB)` (v1/worker/utils.py
    request_memory: free at the init snapshot < ceil(total x util)). The ledger, given that free figure,
    refuses with the same numbers."""
    stems = [s for s, case in CASES.items() if why_not_runnable(case) == REFUSED_AT_START]
    assert stems == ["vllm-0.19.0-h100-codellama-34b-tp2-refused"]
    for stem in stems:
        logged = CASES[stem]["logged"]["refused"]
        refusal = run_ledger(CASES[stem]).refusal
        assert refusal is not None and refusal.startswith("ValueError: Free memory on device"), refusal
        assert FREE_AT_START.search(logged)  # the ledger knows no device name: it prints none
        numbers = re.compile(r"\(([\d.]+)/([\d.]+) GiB\).*\(([\d.]+), ([\d.]+) GiB\)")
        assert numbers.search(refusal).groups() == numbers.search(logged).groups(), (refusal, logged)


def test_the_token_line_of_0290_is_group_aware():
    """0.29.0's `GPU KV cache size` of a sliding + full model: num_blocks / (full blocks + sliding blocks) per
    max-length request x max_model_len (kv_cache_utils.py L1047-1069, L2011-2021), the sliding group holding
    cdiv(W - 1 + 2 x max_num_batched_tokens, block) + 1 with async scheduling (kv_cache_interface.py L704-731)."""
    b = run_ledger(CASES["vllm-0.29.0-l4-gpt-oss-20b"]).budget
    per_request = 32768 // 16 + (-(-(127 + 2 * 4096) // 16) + 1)
    assert per_request == 2048 + 521
    assert b.kv_tokens == int(b.num_blocks / per_request * 32768)
