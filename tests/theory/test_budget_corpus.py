"""The vLLM memory budget against real GPUs: the ledger, run as `kvprobe ledger` runs it with exactly the
flags each start-up log of tests/data/gpu_logs/ states (release, parallel layout, utilisation, lengths,
dtypes; the GPU's total memory as the engine printed it), against the KV pool and the weights the engine
logged. Prints the whole table (logged vs ledger, error, and for a miss the budget term that differs);
asserts the accuracy reached as a floor, and that every case it cannot run says why."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
import yaml

from kvprobe.cli.ledger import gpu_from_args, inputs_from_args
from kvprobe.cli.main import build_parser
from kvprobe.engines import is_known_version
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.model.sizes import GIB

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "data" / "gpu_logs"
CONFIGS = ROOT / "kvprobe" / "theory" / "model" / "configs"
# The corpus README's map of the models to the configs kvprobe ships (an -Instruct model has its base's geometry).
SHIPPED = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b.json",
    # the hub's former name of the same checkpoint (it redirects to meta-llama/Llama-3.1-8B-Instruct)
    "meta-llama/Meta-Llama-3.1-8B-Instruct": "llama-3.1-8b.json",
    "Qwen/Qwen3-8B": "qwen3-8b.json",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b.json",
    "openai/gpt-oss-20b": "gpt-oss-20b.json",
    "openai/gpt-oss-120b": "gpt-oss-120b.json",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": "llama-4-scout-17b-16e-instruct.json",
    "google/gemma-3-27b-it": "gemma-3-27b-it.json",
    "Qwen/Qwen2-7B-Instruct": "qwen2-7b-instruct.json",
    "Qwen/Qwen2.5-72B-Instruct": "qwen2.5-72b-instruct.json",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b-instruct-v0.1.json",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b.json",
    # the 2507 Instruct checkpoint: the same geometry (its config differs in max_position_embeddings and rope_theta)
    "Qwen/Qwen3-30B-A3B-Instruct-2507": "qwen3-30b-a3b.json",
    "deepseek-ai/DeepSeek-V2-Lite-Chat": "deepseek-v2-lite-chat.json",
    # the hub resolves ids case-insensitively; the log spells it "fp8-dynamic"
    "RedHatAI/Llama-3.3-70B-Instruct-fp8-dynamic": "llama-3.3-70b-instruct-fp8-dynamic.json",
    "RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16": "llama-3.1-8b-instruct-w4a16.json",
    "RedHatAI/Mistral-Small-3.1-24B-Instruct-2503-quantized.w8a8": "mistral-small-3.1-24b-instruct-2503-w8a8.json",
    # kept beside the corpus, its provenance inside (an absolute path: CONFIGS / it is itself)
    "codellama/CodeLlama-34b-hf": CORPUS / "vllm-configs" / "codellama-34b-hf.json",
    "codellama/CodeLlama-7b-hf": CORPUS / "vllm-configs" / "codellama-7b-hf.json",
    # the checkpoint's own config.json, its GPTQ quantization_config with it (the file's _provenance says where from)
    "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4": CORPUS / "vllm-configs" / "qwen2.5-7b-instruct-gptq-int4.json",
    # the checkpoint's config.json as a public test embeds it verbatim (its _provenance inside)
    "Qwen/Qwen2.5-1.5B-Instruct": CORPUS / "vllm-configs" / "qwen2.5-1.5b-instruct.json",
    # the SGLang cases' MiniCPM5-1B config (its _provenance inside): the model's geometry, whichever engine loads it
    "OpenBMB/MiniCPM5-1B": CORPUS / "sglang-configs" / "minicpm5-1b.json",
    # the SGLang cases' Qwen2.5-0.5B-Instruct config: the geometry the post prints for its Qwen2.5-0.5B
    "Qwen2.5-0.5B (hub id not stated)": CORPUS / "sglang-configs" / "qwen2.5-0.5b.json",
    "Qwen/Qwen2.5-0.5B-Instruct": CORPUS / "sglang-configs" / "qwen2.5-0.5b.json",
    # microsoft/phi-2's config.json as a public repository commits it (its _provenance inside)
    "microsoft/phi-2": CORPUS / "vllm-configs" / "phi-2.json",
}
WITHIN = 0.05  # the bar for the KV pool
TERMS = (("weights_gib", "weights"), ("activation_peak_gib", "activation"), ("non_torch_gib", "other"))
TERM_NAMES = {"weights": "weights", "activation": "activation peak", "other": "non-torch"}

# The ratchet: what the ledger reaches today. Raise it when a rule improves; never lower it to pass.
FLOOR_WITHIN_5 = 60  # of the runnable cases, KV pool within 5% of the log (58 before the non-torch rule below)
WORST_ALLOWED = WITHIN  # no runnable case beyond 5% but the named misses below
# ... and none of those beyond this: Qwen2.5-72B at TP 2 on H100s (+5.8%). 0.40 before the ledger counted the
# non-torch memory of a profiling window without CUDA graphs (memory_profile.py non_torch_bytes): the RTX 3090's
# 0.49 GiB pool of Qwen2.5-7B at 0.65 was -39% (now -4.1%), Llama-3.1-8B's at 0.75 -7.5% (now +0.5%)
KNOWN_MISS_WORST = 0.06
MEDIAN_ALLOWED = 0.01  # 0.50% today (0.89% before the non-torch rule; 1.46% before corpus7's H100 sweep and A100
# 0.24.0 runs; 1.47% before corpus6's six cases; 1.52% before corpus5's V2 sampler rule and WSL2 cases; 1.02% before
# the corpus3 pass added the RTX 3090 cases at -2.2% to -4.0%)
RUNNABLE = 61  # 60 before corpus10's CodeLlama-7B
# Cases whose KV pool misses by more than 5%, and why (the term that differs, read off the log's own
# breakdown): a fixed term turns the case into a pass, and the test then asks to strike it off.
KNOWN_MISSES = {
    "vllm-0.19.0-h100-qwen25-72b-tp2": "weights: a 3.04 GiB pool under 72.3 GiB of other terms: weights -0.09, "
                                       "activation -0.06, non-torch -0.03 GiB (each within 3%) add up to +0.18 GiB, "
                                       "+6% of so small a pool",
}
# Logs that keep only the token line (no `Available KV cache memory`, no budget terms), compared in tokens:
# a miss beyond 5% with what the log does say.
TOKEN_ONLY_MISSES = {
    "vllm-0.29.0-l4-gpt-oss-20b": "82,819 tokens (2.53x at 32,768) logged, 142,742 (4.36x) the ledger: +72%. The "
                                  "figure is the right one: 0.29.0 prints int(max_concurrency x max_model_len), "
                                  "max_concurrency = num_blocks / the sum over the KV cache groups of each one's "
                                  "blocks per request (kv_cache_utils.py L1047-1069, L2011-2021; V7), the ledger's "
                                  "own claim line for 0.29.0. With the smoke script's --max-num-batched-tokens 4096 "
                                  "and async scheduling, the sliding group holds cdiv(127 + 2 x 4096, 16) + 1 = 521 "
                                  "blocks (kv_cache_interface.py L704-740, config/vllm.py L559-580) beside the full "
                                  "group's 2,048, so vLLM's pool was 6,493 blocks x 384 KiB = 2.38 GiB against the "
                                  "ledger's 4.10: the budget, not the figure. The log keeps no budget line; 0.29.0 "
                                  "runs gpt-oss on the V2 runner (config/vllm.py L645-676, L2539-2604: none of its "
                                  "unsupported features is set), whose greedy dummy sampler holds the logits alone "
                                  "(0.35 GiB of activation with the forward), and subtracts its measured CUDA-graph "
                                  "estimate (gpu_worker.py L559-610; v1/worker/gpu/cudagraph_utils.py L717-808: the "
                                  "free memory consumed by one capture_model() of every PIECEWISE size and the two "
                                  "largest FULL ones, the FULL cost extrapolated first + (n - 1) x second), the "
                                  "ledger takes 0.27 GiB; vLLM's non-KV memory beyond the weights was 2.59 GiB, the "
                                  "ledger's 0.87: 1.72 GiB is missing between activation, graphs and non-torch, which "
                                  "no logged line splits. Not the max_num_batched_tokens-linear transient of vLLM "
                                  "#50780: that is the V1 runner's first FULL capture at max_num_tokens / n tokens "
                                  "of context (gpu_model_runner.py L6809-6817), which the V2 runner does not do, and "
                                  "the same card's tp1-fp8 log (twice the token budget) holds 2.72 GiB, +0.12 where "
                                  "the ledger's terms grow +0.37. The DCGM view after start-up (18,604 MiB used of "
                                  "23,034) leaves 2.10 GiB beside the weights and pool for the CUDA context, "
                                  "non-torch, the captured graphs and the allocator's cache: the graph estimate "
                                  "(MARLIN MXFP4 MoE on sm89, FULL extrapolated) most likely, but no line gives it",
    "vllm-0.29.0-l4-gpt-oss-20b-block96": "82,453 tokens (2.52x) logged, 142,121 the ledger: +72%, the pool 1,082 "
                                          "blocks x 2.25 MiB = 2.38 GiB (--block-size 96: 88 sliding + 342 full "
                                          "blocks per request) against the ledger's 1,865 (4.10 GiB): tp1-auto's run "
                                          "with --block-size 96 on the same card, the "
                                          "same 1.72 GiB missing (vLLM's non-KV beyond the weights 2.59 GiB, the "
                                          "ledger's 0.87) and the same DCGM view (18,606 MiB): the block size moves "
                                          "neither, the term is tp1-auto's (see there)",
    "vllm-0.29.0-l4-gpt-oss-20b-kvfp8-mnbt8192": "130,986 tokens (4.00x) logged, 216,115 the ledger: +65%. The pool "
                                                 "is 4.00 x 771 blocks (259 sliding + 512 full at --block-size 64) x "
                                                 "768 KiB = 2.26 GiB against 3.73: vLLM's non-KV beyond the weights "
                                                 "2.72 GiB, the ledger's 1.25 (0.25 non-torch, 0.70 activation, 0.29 "
                                                 "graphs), 1.47 missing. Against tp1-auto on the same card "
                                                 "(--max-num-batched-tokens 8192 not 4096, --max-num-seqs and the "
                                                 "capture sizes 512 not 256, fp8 KV, --optimization-level 3, "
                                                 "--performance-mode throughput) vLLM's non-KV rose 0.12 GiB, the "
                                                 "ledger's 0.37 (its forward is linear in the token budget): the "
                                                 "missing term is not linear in it. The same unknown term as "
                                                 "tp1-auto's; the DCGM view after start-up is 20,056 MiB (the runtime "
                                                 "holds 1.54 GiB more beside weights and pool than tp1-auto)",
    "vllm-0.29.0-l4x2-gpt-oss-20b-tp2-ep-kvfp8": "1,125,105 tokens (34.34x) logged, 1,046,258 the ledger: -7.0%, "
                                                 "the pool 52,911 blocks x 192 KiB = 9.69 GiB against 9.01. The "
                                                 "ledger's non-torch at TP 2 is the H100 logs' 2.06 GiB (NCCL's "
                                                 "NVLink-switch buffers, memory_profile.py NON_TORCH_TP); two L4s "
                                                 "talk over PCIe, whose NCCL buffers no log of the corpus prints: "
                                                 "the term is not known",
}
TOKEN_ONLY_MISSES["vllm-0.27.1-rtx4090-wsl2-qwen25-0.5b-gmu030-shared"] = (
    "476,672 tokens logged, the ledger +9%: 0.30 x 23.99 GiB - 0.92 GiB of weights - the logged 5.45 GiB pool "
    "leaves 0.82 GiB for the rest, the ledger 0.33 (0.25 non-torch, 0.08 activation; the same model's notebook "
    "log on this card prints 0.30 and 0.31 at four times the token budget). The card was shared with a second "
    "server (Qwen2.5-1.5B); 0.27.1 counts as its own non-KV memory all free memory consumed since its init "
    "snapshot (utils/mem_utils.py L313-326: total_consumed = before_create.free - after_profile.free), so "
    "another process's allocations during this one's profile shrink the pool. Whether the two start-ups "
    "overlapped the post does not say (its order puts this server first): a candidate, not a known term")
TOKEN_ONLY_MISSES["vllm-0.27.1-rtx4090-wsl2-qwen25-1.5b-gmu030-shared"] = (
    "114,432 tokens logged, the ledger +29%: 0.30 x 23.99 GiB - 2.88 GiB of weights - the logged 3.06 GiB pool "
    "leaves 1.26 GiB for the rest, the ledger 0.38 (0.25 non-torch, 0.13 activation, no CUDA graphs). The second "
    "server of the shared card above (its Qwen2.5-0.5B beside it): the same unknown term, larger here, as it "
    "would be if this one's profile ran while the other allocated (utils/mem_utils.py L313-326)")
# The token line, where a release prints it with other semantics than the ledger's. Empty since the ledger
# prints each release's own line: 0.10.1.1's gpt-oss-120b line, 45.32 GiB / (36 x 512 B) = 2,640,144 tokens, is
# num_blocks // 2 groups x 16 (kv_cache_utils.py _report_kv_cache_config through 0.20.0; theory/vllm/releases.py
# KV_SIZE_LINE_FROM), and the ledger's 2,666,928 follows its pool (+1.0%), where the 0.33.0 line it printed
# before did not.
TOKEN_LINE_DIFFERS: dict[str, str] = {}
# Cases whose logged torch peak the ledger's forward/sampler terms miss by more than 5%, and why.
ACTIVATION_NOT_MODELLED = {
    "gemma3": "the vision encoder's profile run (multimodal dummy batch) is not modelled",
    "llama4": "the vision encoder's profile run (multimodal dummy batch) is not modelled",
    "deepseek-v2-lite": "MLA's prefill workspaces (up-projected K/V of the chunk) are not modelled",
    "qwen3-30b-a3b": "the fused-MoE kernel's caches are modelled from the widest expert rows only",
    "mixtral-8x7b": "the fused-MoE kernel's caches are modelled from the widest expert rows only",
    "mistral-small": "the Pixtral encoder's profile run (multimodal dummy batch) is not modelled",
    "phi-2": "the ledger's peak here is its sampler warm-up (0.75 GiB: max_num_seqs 1,024 rows of a 51,200 vocab), "
             "above its forward (0.39 GiB: fc1's 10,240-wide output over 8,192 tokens); the log's 0.79 GiB is split "
             "by no line, so which term is short is not known",
    "0.26.0-a40": "0.26.0's V2 model runner profile (v1/worker/gpu/model_runner.py profile_run L673-688: the "
                  "forward, then one greedy sampler call on max_num_seqs rows: memory_profile.py ProfileRules "
                  "0.26.0) logs 1.01 GiB for both checkpoints; the ledger's forward of 2,048 tokens is 0.23 "
                  "GiB (the logits 0.06). The same rule gives 0.27.1's Qwen3-8B logs on an RTX 4090 exactly "
                  "(0.00%, test_budget_corpus_releases.py); what else the A40 runs' profile holds (a 0.26.0 "
                  "V2 forward under VLLM_COMPILE?) is not read",
}


def load_cases() -> dict[str, dict]:
    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted(CORPUS.glob("*.yaml"))}


CASES = load_cases()


def why_not_runnable(case: dict) -> str | None:
    """None when the ledger can be run on the case as its log states it; else the reason."""
    logged = case["logged"]
    if case["engine"] != "vllm":
        return f"engine {case['engine']}: no SGLang case in the corpus"
    if case["model"] not in SHIPPED:
        return f"no config.json shipped for {case['model']}"
    if not is_known_version("vllm", case["version"]):
        if re.search(r"rc|dev", case["version"]):
            return f"release {case['version']} not read (a build between releases)"
        return (f"release {case['version']} not read: a final release kvprobe holds no facts for "
                f"(`kvprobe ledger --engine-version {case['version']}` refuses it)")
    if logged.get("refused") and FREE_AT_START.search(logged["refused"]) and "kv_cache_gib" not in logged:
        return REFUSED_AT_START
    if logged.get("refused") and REFUSED_SIZING.search(logged["refused"]):
        return REFUSED_AT_SIZING
    if "kv_cache_gib" not in logged and not (logged.get("kv_tokens") and not logged.get("refused")):
        return "the log prints no KV pool (refused before sizing it)"
    if "total_gpu_gib" not in logged and "gpu_total" not in case and gpu_by_name(case) is None:
        return ("the log prints no total GPU memory (no 'total_memory=' or 'Free memory on device' line, no "
                f"nvidia-smi memory.total: `gpu_total`), and kvprobe has no GPU named {case['gpu']!r}")
    argv = ledger_argv(case)
    _, extra = build_parser(argv).parse_known_args(argv)
    if extra:
        return f"flags the ledger does not take: {extra}"
    if "kv_cache_gib" not in logged:
        return TOKENS_ONLY
    return None


# Cards of compute capability 8.9 (Ada) as the cases name them: vLLM runs MXFP4 experts with MARLIN there.
ADA_CARDS = {"NVIDIA L4", "NVIDIA L40S", "NVIDIA GeForce RTX 4090"}
TOKENS_ONLY = "the log prints the pool in tokens only: compared in tokens (test_pools_logged_in_tokens_only)"
REFUSED_AT_START = "refused at start-up, before any pool: the refusal is checked (test_budget_corpus_refusals.py)"
REFUSED_AT_SIZING = ("refused when sizing the pool (too small or negative): the refusal is checked, the pool "
                     "is not compared (test_budget_corpus_refusals.py)")
# The pool too small for one max-length request (v1/core/kv_cache_utils.py check_enough_kv_cache_memory), or
# none at all (v1/worker/gpu_worker.py, available memory <= 0): 0.17.1's wording, the same through 0.33.0.
REFUSED_SIZING = re.compile(r"ValueError: (To serve at least one request|No available memory for the cache blocks)")
# vLLM's start-up check prints the free memory its init snapshot read (v1/worker/utils.py request_memory)
FREE_AT_START = re.compile(r"Free memory on device \S+ \(([\d.]+)/[\d.]+ GiB\) on startup")


def gpu_by_name(case: dict):
    """The card the case names, when kvprobe lists it (spec/gpus.py), else None."""
    from kvprobe.errors import ConfigError
    from kvprobe.spec.gpus import find_gpu

    try:
        return find_gpu(case["gpu"].split(" (")[0], key="gpu")  # "A100 80GB (log file name ...)"
    except ConfigError:
        return None


def ledger_argv(case: dict) -> list[str]:
    """`kvprobe ledger` as a person would type it for this log: its flags, its release, its GPU memory."""
    if "total_gpu_gib" in case["logged"]:
        total = round(case["logged"]["total_gpu_gib"] * GIB)  # the engine prints it rounded to 0.01 GiB
        gpu = ["--gpu-memory", f"{total}B"]
    elif "gpu_total" in case:  # the post's nvidia-smi memory.total (the schema test checks it is the log's)
        gpu = ["--gpu-memory", f"{case['gpu_total']['mib']}MiB"]
    else:  # by name: its CUDA total, and the name vLLM's batch defaults read (A100: 256 seqs / 2048 tokens)
        gpu = ["--gpu", gpu_by_name(case).name]
    argv = ["ledger", "--engine", "vllm", "--model", str(CONFIGS / SHIPPED[case["model"]]),
            "--engine-version", case["version"], *gpu]
    free = FREE_AT_START.search(case["logged"].get("refused") or "")
    if free:  # a shared card: the free memory the refusal prints
        argv += ["--gpu-free-memory", f"{free.group(1)}GiB"]
    if case.get("quantization") == "mxfp4" and (case["gpu"].split(" (")[0] in ADA_CARDS):
        argv += ["--gpu-arch", "sm89"]  # the MXFP4 experts' MARLIN padding (model/mxfp4.py)
    for key, value in case["flags"].items():
        name = key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{name}" if value else f"--no-{name}")
        else:
            argv += [f"--{name}", str(value)]
    return argv


def run_ledger(case: dict):
    argv = ledger_argv(case)
    args, extra = build_parser(argv).parse_known_args(argv)
    assert not extra, f"flags the ledger does not take: {extra}"
    return build_ledger(inputs_from_args(args, gpu_from_args(args)), explain_refusal=True)


def compare(stem: str, case: dict) -> dict:
    led = run_ledger(case)
    b, logged = led.budget, case["logged"]
    row = {"case": stem, "logged_gib": logged["kv_cache_gib"], "ledger_gib": b.kv_pool_bytes / GIB,
           "logged_tokens": logged.get("kv_tokens"), "ledger_tokens": b.kv_tokens}
    row["error"] = row["ledger_gib"] / row["logged_gib"] - 1
    diffs = []
    for key, attr in TERMS:
        if key in logged:
            ours = getattr(b, attr) / GIB
            row[attr] = (logged[key], ours)
            diffs.append((abs(ours - logged[key]), TERM_NAMES[attr], logged[key], ours))
    if "cuda_graph_gib" in logged and b.cudagraph_subtracted:
        ours = b.cudagraph / GIB
        diffs.append((abs(ours - logged["cuda_graph_gib"]), "CUDA graph", logged["cuda_graph_gib"], ours))
    big = max(diffs, default=None)
    row["reason"] = "" if big is None else f"{big[1]} {big[3]:.2f} vs {big[2]:.2f} GiB logged"
    row["refused"] = led.refusal is not None
    return row


@pytest.fixture(scope="module")
def table() -> tuple[list[dict], dict[str, str]]:
    rows, skipped = [], {}
    for stem, case in CASES.items():
        reason = why_not_runnable(case)
        if reason is None:
            rows.append(compare(stem, case))
        else:
            skipped[stem] = reason
    lines = [f"{'case':48} {'KV logged':>9} {'ledger':>7} {'error':>7} {'tokens':>9} {'ledger':>9}  largest term gap"]
    for r in rows:
        lines.append(f"{r['case'][:48]:48} {r['logged_gib']:9.2f} {r['ledger_gib']:7.2f} {r['error']:+7.1%} "
                     f"{r['logged_tokens'] or 0:9d} {r['ledger_tokens']:9d}  {r['reason']}")
    lines += ["", "not run:"] + [f"  {s}: {why}" for s, why in skipped.items()]
    print("\n" + "\n".join(lines))
    return rows, skipped


def test_every_case_is_run_or_says_why(table):
    rows, skipped = table
    assert len(rows) + len(skipped) == len(CASES)
    assert len(rows) >= RUNNABLE, f"{len(rows)} cases run, {RUNNABLE} before: {sorted(skipped)}"
    for stem, why in skipped.items():
        assert why, stem


def test_kv_pool_accuracy_ratchet(table):
    rows, _ = table
    errors = [abs(r["error"]) for r in rows]
    within = [r["case"] for r in rows if abs(r["error"]) <= WITHIN]
    assert len(within) >= FLOOR_WITHIN_5, f"{len(within)} of {len(rows)} within 5% (floor {FLOOR_WITHIN_5})"
    unnamed = [abs(r["error"]) for r in rows if r["case"] not in KNOWN_MISSES]
    assert max(unnamed) <= WORST_ALLOWED, f"worst {max(unnamed):.1%} beyond {WORST_ALLOWED:.0%}"
    assert max(errors) <= KNOWN_MISS_WORST, f"worst named miss {max(errors):.1%} beyond {KNOWN_MISS_WORST:.0%}"
    assert statistics.median(errors) <= MEDIAN_ALLOWED, f"median {statistics.median(errors):.1%}"


def test_misses_are_the_known_ones(table):
    rows, _ = table
    misses = {r["case"] for r in rows if abs(r["error"]) > WITHIN}
    assert misses <= set(KNOWN_MISSES), f"new misses: {sorted(misses - set(KNOWN_MISSES))}"
    fixed = set(KNOWN_MISSES) - misses
    assert not fixed, f"now within 5%: strike off KNOWN_MISSES and raise FLOOR_WITHIN_5: {sorted(fixed)}"
    for row in rows:  # a miss is put down to weights; check the log says so
        if row["case"] in misses:
            assert row["reason"].startswith("weights"), (row["case"], row["reason"])


def test_kv_tokens_follow_the_pool(table):
    """The token line follows the pool: the same error as the bytes, within the block rounding."""
    rows, _ = table
    for r in rows:
        if r["logged_tokens"] and r["case"] not in TOKEN_LINE_DIFFERS:
            token_error = r["ledger_tokens"] / r["logged_tokens"] - 1
            assert abs(token_error - r["error"]) < 0.02, (r["case"], token_error, r["error"])


def token_error(case: dict) -> float:
    """The ledger's error on a log that prints the pool in tokens only (TOKENS_ONLY)."""
    return run_ledger(case).budget.kv_tokens / case["logged"]["kv_tokens"] - 1


def test_pools_logged_in_tokens_only(table):
    """The cases whose log keeps the token line only run in tokens: each within 5% or a named miss."""
    _, skipped = table
    errors = {}
    for stem in (s for s, why in skipped.items() if why == TOKENS_ONLY):
        logged = CASES[stem]["logged"]["kv_tokens"]
        errors[stem] = token_error(CASES[stem])
        print(f"tokens only: {stem}: {logged} logged, ledger {errors[stem]:+.1%}")
    assert set(TOKEN_ONLY_MISSES) <= set(errors), "a named token-only miss no longer runs"
    misses = {s for s, e in errors.items() if abs(e) > WITHIN}
    assert misses == set(TOKEN_ONLY_MISSES), {s: errors[s] for s in misses ^ set(TOKEN_ONLY_MISSES)}


def test_weights_where_logged(table):
    """Weights within 2% where the log prints them, except the known weight misses (and gpt-oss's MXFP4
    experts, padded for the kernel: 12.83 vs 13.64 GiB at TP1). The multimodal checkpoints count their vision
    tower (vision.py) and vLLM's rotary cache (Llama-4-Scout's 10M positions: 2.5 GiB)."""
    rows, _ = table
    off = {r["case"]: r["weights"] for r in rows
           if "weights" in r and abs(r["weights"][1] / r["weights"][0] - 1) > 0.02}
    expected = set(KNOWN_MISSES) | {s for s in off if "gpt-oss" in s}
    assert set(off) <= expected, {s: off[s] for s in set(off) - expected}


def test_online_fp8_counts_the_linear_layers_at_one_byte():
    """`--quantization fp8` on the bf16 Llama-3.1-8B: vLLM loads 8.49 GiB (the log above); embeddings and
    lm_head stay bf16 (1.96 GiB), the 6.98 B linear parameters take one byte each."""
    row = compare("vllm-0.19.0-h100-llama31-8b-fp8", CASES["vllm-0.19.0-h100-llama31-8b-fp8"])
    logged, ours = row["weights"]
    assert abs(ours / logged - 1) < 0.01


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq", "gguf"])
def test_a_quantisation_kvprobe_cannot_count_is_an_error(tmp_path, method):
    """Never a silent bf16: the checkpoint's quant_method is named, with the file."""
    from kvprobe.errors import ConfigError
    from kvprobe.theory.ledger.build import LedgerInputs

    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        build_ledger(LedgerInputs(engine="vllm", model=str(path), gpu_memory_bytes=80 * GIB, max_model_len=8192))
    assert err.value.key == "quantization_config.quant_method" and repr(method) in str(err.value)
    assert str(path) in str(err.value)


def test_quantization_flag_that_contradicts_the_checkpoint_is_refused():
    from kvprobe.errors import ConfigError
    from kvprobe.theory.ledger.build import with_quantization

    assert with_quantization({"quantization_config": {"quant_method": "fp8"}}, "fp8", "c.json")["quantization_config"]
    with pytest.raises(ConfigError, match="does not match"):
        with_quantization({"quantization_config": {"quant_method": "mxfp4"}}, "fp8", "c.json")
    with pytest.raises(ConfigError, match="expected fp8"):
        with_quantization({}, "awq", "c.json")


def test_activation_peak_where_logged(table):
    """The sampler warm-up rule against the torch peak the logs print: within 5% for the dense text
    models; the others lower, each for a reason in ACTIVATION_NOT_MODELLED."""
    rows, _ = table
    close = [r["case"] for r in rows if "activation" in r and abs(r["activation"][1] / r["activation"][0] - 1) <= 0.05]
    assert len(close) >= 11, close
    for r in rows:
        if "activation" in r and r["case"] not in close:
            assert any(k in r["case"] for k in ACTIVATION_NOT_MODELLED), (r["case"], r["activation"])
            assert r["activation"][1] < r["activation"][0], (r["case"], r["activation"])


NON_TORCH_WITHIN = 0.025  # GiB
# Cases whose logged non-torch term the ledger's one-rank rule does not give, and why.
NON_TORCH_NOT_MODELLED = {
    "-pp": "with pipeline parallelism NCCL is set up before the init snapshot (its figure 1.43 GiB against 0.51 at "
           "one rank), and the window's increase is 0.07 GiB although it profiles graphs: what the one-rank "
           "window adds is not split by any line (0.19.0's pp2 and pp4 logs)",
}


def test_non_torch_where_logged(table):
    """The ledger's non-torch term against the one the logs print at one rank: 0.24-0.27 GiB where the window
    profiles CUDA graphs (0.19.0 on H100), 0.08 where it does not (0.26.0's V2 runner on an A40), each within
    0.025 GiB (the logs print two decimals); the exceptions named."""
    rows, _ = table
    seen = {"graphs": 0, "none": 0}
    for r in rows:
        case = CASES[r["case"]]
        if "other" not in r or case.get("tensor_parallel", 1) != 1:
            continue
        logged, ours = r["other"]
        if any(k in r["case"] for k in NON_TORCH_NOT_MODELLED):
            assert abs(ours - logged) > NON_TORCH_WITHIN, f"{r['case']}: now modelled: strike it off"
            continue
        assert abs(ours - logged) <= NON_TORCH_WITHIN, (r["case"], logged, ours)
        seen["graphs" if logged > 0.15 else "none"] += 1
    assert seen["graphs"] >= 9 and seen["none"] >= 2, seen
