"""Issue 20's bar over the whole corpus of real GPU start-up logs, both engines together: the ledger's
KV pool within 5% of what the engine logged for at least 90% of the cases it can run, each miss named
with its reason. The per-engine files hold the ratchets and the reasons (test_budget_corpus.py for
vLLM in bytes and in tokens, test_budget_corpus_sglang.py); this one adds them up.

The corpus is not trimmed to meet the bar: a case that becomes runnable counts, missed or not. So
this file holds the count within 5% as a ratchet (it may only rise) and says whether the bar is met;
it was met (63 of 70) until the shared card's Qwen2.5-1.5B case could be run (its config found): 63
of 71; 64 of 72 with phi-2 (corpus9 pass: +0.1%, once the ledger counted phi's MLP as vLLM builds
it); 65 of 73 with CodeLlama-7B (corpus10 pass: +0.0%); 67 of 73, the bar met, once the ledger counted the
non-torch memory of a profiling window that captures no CUDA graphs (vLLM up to 0.17, --enforce-eager, the V2
runner's dense models up to 0.26) as the A40 logs print it, 0.08 GiB, not the H100 logs' 0.25 of a window that
does (memory_profile.py non_torch_bytes): the seven RTX 3090 logs of 0.17.1, two of them misses before, all
within 1.4% but the smallest pool's -4.1%. 67 of 75, the bar not met, once the two other TP 1 runs of the
0.29.0 gpt-oss-20b L4 smoke log were added (--block-size 96: +72%; --max-num-batched-tokens 8192 with fp8 KV:
+65%): the same unknown non-KV term as tp1-auto's, so one missing term now costs three cases.
"""

from __future__ import annotations

import test_budget_corpus as vllm_corpus
import test_budget_corpus_sglang as sglang_corpus

BAR = (9, 10)  # of the runnable cases, within 5%: nine in ten
WITHIN = 0.05
WITHIN_AT_LEAST = 67  # the ratchet: runnable cases within 5% today
# Beyond 15% (the issue asks for none): three token-only runs of one L4 smoke log (0.29.0 gpt-oss-20b) whose
# 1.5-1.7 GiB of non-KV memory no line splits, and the second server of a shared card. Each is a named miss with its
# reason in its engine's file.
BEYOND_15 = {"vllm-0.29.0-l4-gpt-oss-20b", "vllm-0.29.0-l4-gpt-oss-20b-block96",
             "vllm-0.29.0-l4-gpt-oss-20b-kvfp8-mnbt8192", "vllm-0.27.1-rtx4090-wsl2-qwen25-1.5b-gmu030-shared"}


def errors() -> dict[str, float]:
    """The ledger's error on every runnable case: vLLM in bytes, or in tokens where that is all the log
    prints; SGLang in max_total_num_tokens, or in bytes where that is all the log prints."""
    out = {}
    for stem, case in vllm_corpus.CASES.items():
        why = vllm_corpus.why_not_runnable(case)
        if why is None:
            out[stem] = vllm_corpus.compare(stem, case)["error"]
        elif why == vllm_corpus.TOKENS_ONLY:
            out[stem] = vllm_corpus.token_error(case)
    for stem, case in sglang_corpus.CASES.items():
        if sglang_corpus.why_not_runnable(case) is None:
            out[stem] = sglang_corpus.compare(stem, case)["error"]
    return out


def test_the_ledger_is_within_5_percent_on_90_percent_of_the_runnable_logs():
    errs = errors()
    named = {**vllm_corpus.KNOWN_MISSES, **vllm_corpus.TOKEN_ONLY_MISSES, **sglang_corpus.KNOWN_MISSES}
    misses = {stem: e for stem, e in errs.items() if abs(e) > WITHIN}
    for stem, e in sorted(misses.items()):
        print(f"miss {e:+.1%} {stem}: {named.get(stem, 'UNNAMED')}")
    within = len(errs) - len(misses)
    met = within * BAR[1] >= len(errs) * BAR[0]
    print(f"{within} of {len(errs)} runnable cases within 5% ({within / len(errs):.1%}): the bar of {BAR[0]} in "
          f"{BAR[1]} is {'met' if met else 'not met'}")
    assert set(misses) <= set(named), f"unnamed misses: {sorted(set(misses) - set(named))}"
    assert within >= WITHIN_AT_LEAST, f"{within} of {len(errs)} within 5%, fewer than the {WITHIN_AT_LEAST} before"
    assert {stem for stem, e in errs.items() if abs(e) > 0.15} == BEYOND_15
