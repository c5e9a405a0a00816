"""The vLLM releases' memory-profile rules as the corpus's logs show them (test_budget_corpus.py holds the
cases and the ledger's command line for each): which release's rules a version takes, what a log's own
terms add up to, the GPUs' totals by name, and the V2 model runner's missing CUDA-graph estimate."""

from __future__ import annotations

import re

import pytest
from test_budget_corpus import CASES, CONFIGS, compare, gpu_by_name, run_ledger

from kvprobe.theory.model.sizes import GIB

# Cards whose total by name (spec/gpus.py) differs from the one a corpus log prints by more than the print's
# rounding, with the reason: the by-name figure stays the cited one, the case runs with its log's own total.
TOTAL_DIFFERS = {
    "A40": "spec/gpus.py's A40 is a deviceQuery under driver 550.127.05 (45403 MiB, 44.34 GiB); the 0.26.0 A40 "
           "logs of vireshkoli/LLM-Inference-Optimization (driver 570.133.07, ECC on) print 44.43 GiB",
}


def test_the_release_rules_the_logs_show():
    """What the 0.19.0 logs print themselves: available = ceil(total x util) - weights - torch peak -
    non-torch, the CUDA-graph estimate not subtracted (gpu_worker.py; its own debug line says so)."""
    case = CASES["vllm-0.19.0-h100-llama31-8b-tp1"]
    logged = case["logged"]
    requested = logged["total_gpu_gib"] * case["flags"]["gpu_memory_utilization"]
    with_graph = requested - logged["weights_gib"] - logged["activation_peak_gib"] - logged["non_torch_gib"]
    assert abs(with_graph - logged["kv_cache_gib"]) < 0.02
    assert re.search(r"Estimated CUDA graph memory: [\d.]+ GiB total", case["log"])
    row = compare("vllm-0.19.0-h100-llama31-8b-tp1", case)
    assert abs(row["activation"][1] - logged["activation_peak_gib"]) / logged["activation_peak_gib"] < 0.05


@pytest.mark.parametrize(("version", "release", "util", "graph"), [
    ("0.9.2", "0.9.2", 0.9, "subtracted"), ("0.10.0", "0.10.0", 0.9, "none"), ("0.10.1.1", "0.10.0", 0.9, "none"),
    ("0.10.2", "0.10.0", 0.9, "none"), ("0.11.0", "0.11.0", 0.9, "none"),
    ("0.15.1", "0.14.0", 0.9, "none"), ("0.19.0", "0.18.0", 0.9, "logged"), ("0.19.1", "0.18.0", 0.9, "logged"),
    ("0.20.1", "0.20.0", 0.92, "subtracted"), ("0.24.0", "0.21.0", 0.92, "subtracted"),
    ("0.25.1", "0.25.0", 0.92, "subtracted"), ("0.26.0", "0.26.0", 0.92, "subtracted"),
    ("0.27.1", "0.27.0", 0.92, "subtracted"),
    ("0.29.0", "0.29.0", 0.92, "subtracted"), ("0.33.0", "0.33.0", 0.92, "subtracted")])
def test_each_release_takes_the_rules_of_the_release_that_changed_them(version, release, util, graph):
    from kvprobe.theory.vllm.memory_profile import profile_rules
    from kvprobe.theory.vllm.releases import vllm_default_gpu_memory_utilization

    rules = profile_rules(version)
    assert (rules.release, rules.gpu_memory_utilization, rules.cudagraph) == (release, util, graph)
    assert vllm_default_gpu_memory_utilization(version) == util


def test_the_ledger_prints_the_rule_it_applied():
    from kvprobe.theory.ledger.text import render_ledger

    text = render_ledger(run_ledger(CASES["vllm-0.19.0-h100-llama31-8b-tp1"]))
    assert "memory profile          vLLM 0.18.0" in text  # 0.19.0 runs the rules 0.18.0 changed
    assert "CUDA-graph estimate logged, not subtracted" in text and "not subtracted by this release" in text


def test_gpus_by_name_have_the_total_the_logs_print():
    """Where a log prints the card's total (vLLM's `total_memory=79.19GiB`, or `Free memory on device
    (x/79.19 GiB)`), kvprobe's figure for that card by name (spec/gpus.py) is the same within 0.02 GiB: the
    print's rounding and a few MiB between driver releases (H100: 79.19 in these logs, 79.205 in deviceQuery's)."""
    checked = 0
    for stem, case in CASES.items():
        gpu = gpu_by_name(case)
        if gpu is not None and "total_gpu_gib" in case["logged"] and gpu.name not in TOTAL_DIFFERS:
            assert abs(gpu.total_bytes / GIB - case["logged"]["total_gpu_gib"]) <= 0.02, (stem, gpu.name)
            checked += 1
    assert checked >= 19


def test_the_v2_runner_releases_subtract_no_graph_estimate_for_dense_models():
    """0.25.0-0.28.0 run dense (and a few MoE) models on the V2 model runner, whose profile_cudagraph_memory
    returns 0 (memory_profile.py, ProfileRules "0.25.0"); 0.24.0 did not default them to it, 0.29.0 estimates."""
    import json

    from kvprobe.theory.model.geometry import geometry_from_config
    from kvprobe.theory.vllm.memory_profile import graph_estimate_is_zero, profile_rules

    def geom(name):
        return geometry_from_config(json.loads((CONFIGS / name).read_text()))

    dense, moe, mla_moe = geom("llama-3.1-8b.json"), geom("qwen3-30b-a3b.json"), geom("deepseek-v2-lite-chat.json")
    linear = geom("qwen3-next-80b-a3b-instruct.json")
    assert [graph_estimate_is_zero(profile_rules(v), dense) for v in ("0.24.0", "0.26.0", "0.28.0", "0.29.0")] == \
        [False, True, True, False]
    assert not graph_estimate_is_zero(profile_rules("0.26.0"), moe)  # MoE stays on V1 ...
    assert graph_estimate_is_zero(profile_rules("0.26.0"), mla_moe)  # ... but DeepseekV2ForCausalLM is listed
    assert not graph_estimate_is_zero(profile_rules("0.26.0"), linear)  # a linear-attention hybrid: V1


def test_the_0260_log_adds_up_without_a_graph_term():
    """The A40 log's own terms give its pool with no CUDA-graph term (the V2 runner's estimate is 0): requested
    39.99 GiB - weights - peak activation - non-torch = the logged pool, within the print's rounding."""
    for stem in ("vllm-0.26.0-a40-llama31-8b", "vllm-0.26.0-a40-llama31-8b-w4a16"):
        logged = CASES[stem]["logged"]
        requested = float(re.search(r"utilization is \(0\.9, ([\d.]+) GiB\)", CASES[stem]["log"]).group(1))
        rest = requested - logged["weights_gib"] - logged["activation_peak_gib"] - logged["non_torch_gib"]
        assert abs(rest - logged["kv_cache_gib"]) < 0.02, (stem, rest)
        assert run_ledger(CASES[stem]).budget.cudagraph == 0, stem  # and the ledger takes none


def test_the_v2_runner_warms_its_sampler_on_greedy_dummy_requests():
    """0.25.0-0.28.0's V2 model runner (every model's from 0.29.0) samples dummy requests with the default
    sampling states (temperature 0, top_k = vocab, top_p = 1; v1/worker/gpu/sample/states.py L22-34): no
    top-k/top-p path, the logits and (0.25.0 only) one fp32 copy of them (sample/sampler.py). The forward is
    then the larger term. The RTX 4090 (WSL2) Qwen3-8B logs of 0.27.1 add up with it: 0.90 x 23.99 GiB -
    15.27 weights - 5.87 pool = 0.45 GiB for non-torch and activation, below V1's sampler warm-up alone
    (0.60 GiB at 256 rows x 151,936)."""
    import json

    from kvprobe.theory.model.geometry import geometry_from_config
    from kvprobe.theory.vllm.memory_profile import profile_rules, sampler_warmup_bytes

    geom = geometry_from_config(json.loads((CONFIGS / "qwen3-8b.json").read_text()))
    rows, vocab, hidden = 256, geom.vocab_size, 2048 * geom.hidden_size * 2

    def warmup(version):
        return sampler_warmup_bytes(geom, profile_rules(version), max_num_seqs=rows, max_num_batched_tokens=2048)

    assert warmup("0.25.0") == rows * vocab * (2 + 4) + hidden
    assert warmup("0.26.0") == warmup("0.28.0") == rows * vocab * 2 + hidden
    assert warmup("0.24.0") > 0.55 * GIB  # V1's FlashInfer + forward_native warm-up
    moe = geometry_from_config(json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text()))
    assert sampler_warmup_bytes(moe, profile_rules("0.27.1"), max_num_seqs=rows, max_num_batched_tokens=2048) > \
        rows * moe.vocab_size * 8  # an MoE model stays on V1 and its rule ...
    assert sampler_warmup_bytes(moe, profile_rules("0.29.0"), max_num_seqs=rows, max_num_batched_tokens=2048) == \
        rows * moe.vocab_size * 2 + 2048 * moe.hidden_size * 2  # ... until 0.29.0 gives every model the V2 runner
    for stem in ("vllm-0.27.1-rtx4090-wsl2-qwen3-8b-gmu085", "vllm-0.27.1-rtx4090-wsl2-qwen3-8b-gmu090"):
        row = compare(stem, CASES[stem])
        assert abs(row["error"]) < 0.005, (stem, row["error"])


def test_the_triton_sampler_rows_follow_the_cards_own_sms():
    """The triton top-k/top-p kernel keeps min(next_pow2(min(SMs, rows)), SMs) vocab rows of fp32 and reads the
    device's own SM count (0.17.1 v1/sample/ops/topk_topp_triton.py L992-1000, num_compute_units): an RTX 3090
    by name is 82 SMs (its deviceQuery, spec/gpus.py), not the sm90 default's 132."""
    import json

    from kvprobe.spec.gpus import find_gpu
    from kvprobe.theory.model.geometry import geometry_from_config
    from kvprobe.theory.vllm.memory_profile import profile_rules, sampler_warmup_bytes

    geom = geometry_from_config(json.loads((CONFIGS / "llama-3.1-8b.json").read_text()))
    rules = profile_rules("0.17.1")
    by_arch = sampler_warmup_bytes(geom, rules, max_num_seqs=256, max_num_batched_tokens=2048)
    on_3090 = sampler_warmup_bytes(geom, rules, max_num_seqs=256, max_num_batched_tokens=2048,
                                   gpu_sms=find_gpu("RTX-3090", key="gpu").sms)
    assert by_arch - on_3090 == (132 - 82) * geom.vocab_size * 4
    case = CASES["vllm-0.17.1-rtx3090-llama31-8b"]
    assert run_ledger(case).budget.activation == on_3090  # the corpus runs the card by name: its SMs
