"""One release rule: the admission policy the ledger applies to a version is the one the emulator
applies (the engine dialect's `policy()`), for every known release and the ones between them."""

import pytest

from kvprobe.engines import get_dialect
from kvprobe.errors import ConfigError
from kvprobe.releases import KNOWN_VERSIONS, version_tuple
from kvprobe.theory.admission import policy_for
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.sglang import releases as sglang_releases
from kvprobe.theory.vllm import releases as vllm_releases

GIB = 2**30
BETWEEN = {"vllm": ("0.10.2", "0.18.2", "0.32.1"), "sglang": ("0.5.21.post1", "0.5.22")}
CASES = [(engine, v) for engine in ("vllm", "sglang") for v in (*KNOWN_VERSIONS[engine], *BETWEEN[engine])]


def _ledger_policy(engine: str, version: str, **kw) -> str:
    size = {"max_model_len": 8192} if engine == "vllm" else {"context_length": 8192}
    led = build_ledger(LedgerInputs(engine=engine, model="meta-llama/Llama-3.1-8B", gpu_memory_bytes=24 * GIB,
                                    engine_version=version, **size, **kw))
    return led.scheduler_config.policy


@pytest.mark.parametrize(("engine", "version"), CASES)
def test_the_ledger_and_the_emulator_apply_the_same_policy(engine, version):
    emulator = get_dialect(engine).policy(version)
    assert policy_for(engine, version) == emulator
    assert _ledger_policy(engine, version) == emulator


@pytest.mark.parametrize("version", (*KNOWN_VERSIONS["vllm"], *BETWEEN["vllm"]))
@pytest.mark.parametrize("reserve_full_isl", [True, False])
def test_vllm_reserve_full_isl_is_read_the_same_way(version, reserve_full_isl):
    emulator = get_dialect("vllm").policy(version, reserve_full_isl=reserve_full_isl)
    assert policy_for("vllm", version, reserve_full_isl=reserve_full_isl) == emulator
    assert _ledger_policy("vllm", version, reserve_full_isl=reserve_full_isl) == emulator


def test_the_release_rules():
    assert [vllm_releases.policy(v) for v in ("0.9.2", "0.11.0", "0.12.0", "0.18.1", "0.19.0", "0.33.0")] == \
        ["vllm-0.11", "vllm-0.11", "vllm-0.11", "vllm-0.11", "vllm-0.33", "vllm-0.33"]
    assert vllm_releases.policy("0.33.0", reserve_full_isl=False) == "vllm-0.11"
    assert [sglang_releases.policy(v) for v in ("0.5.21", "0.5.21.post1", "0.5.22", "0.5.23")] == \
        ["sglang-0.5.21", "sglang-0.5.21", "sglang-0.5.22", "sglang-0.5.22"]


# What each vLLM release's wheel says, read file by file (not derived from kvprobe's tables): admission
# (v1/core/sched/scheduler.py: can_fit_full_sequence / scheduler_reserve_full_isl from 0.19.0);
# config/cache.py gpu_memory_utilization; request_memory's ceil (v1/worker/utils.py); the CUDA-graph
# estimate (gpu_worker.py + envs.py VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS default); the dummy sampler's
# top-k/top-p path (topk_topp_sampler.py + envs.py VLLM_USE_FLASHINFER_SAMPLER default, on an H100).
READ = {  # release: (policy, util, ceil, graph, sampler)
    # 0.10.0-0.10.2: 0.10.1.1's budget, read in each wheel (determine_available_memory, memory_profiling)
    **{v: ("vllm-0.11", 0.9, False, "none", "flashinfer") for v in ("0.10.0", "0.10.1", "0.10.1.1", "0.10.2")},
    "0.11.0": ("vllm-0.11", 0.9, False, "none", "flashinfer"),
    "0.11.1": ("vllm-0.11", 0.9, False, "none", "torch"), "0.11.2": ("vllm-0.11", 0.9, False, "none", "torch"),
    "0.12.0": ("vllm-0.11", 0.9, False, "none", "torch"), "0.13.0": ("vllm-0.11", 0.9, False, "none", "torch"),
    "0.14.0": ("vllm-0.11", 0.9, True, "none", "torch"), "0.14.1": ("vllm-0.11", 0.9, True, "none", "torch"),
    "0.15.0": ("vllm-0.11", 0.9, True, "none", "torch"), "0.15.1": ("vllm-0.11", 0.9, True, "none", "torch"),
    "0.16.0": ("vllm-0.11", 0.9, True, "none", "torch"),
    "0.17.0": ("vllm-0.11", 0.9, True, "none", "triton"), "0.17.1": ("vllm-0.11", 0.9, True, "none", "triton"),
    "0.18.0": ("vllm-0.11", 0.9, True, "logged", "triton"), "0.18.1": ("vllm-0.11", 0.9, True, "logged", "triton"),
    "0.19.0": ("vllm-0.33", 0.9, True, "logged", "triton"), "0.19.1": ("vllm-0.33", 0.9, True, "logged", "triton"),
    **{v: ("vllm-0.33", 0.92, True, "subtracted", "triton") for v in ("0.20.0", "0.20.1", "0.20.2")},
    **{v: ("vllm-0.33", 0.92, True, "subtracted", "flashinfer")
       for v in ("0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1",
                 "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")},
}


@pytest.mark.parametrize("version", sorted(READ, key=version_tuple))
def test_each_vllm_release_runs_the_rules_its_source_has(version):
    from kvprobe.theory.vllm.memory_profile import profile_rules

    rules = profile_rules(version)
    assert (vllm_releases.policy(version), rules.gpu_memory_utilization, rules.requested_ceil, rules.cudagraph,
            rules.sampler) == READ[version]
    assert not rules.legacy and rules.snapshot_after_distributed == (version_tuple(version) >= (0, 11))


def test_every_vllm_release_read_is_known_and_every_known_one_was_read():
    assert set(READ) | {"0.9.2", "0.33.0", "0.34.0"} == set(KNOWN_VERSIONS["vllm"])


def test_a_rule_is_keyed_by_the_release_that_changed_it():
    from kvprobe.theory.vllm.memory_profile import RULES

    fields = [(r.gpu_memory_utilization, r.requested_ceil, r.cudagraph, r.sampler, r.snapshot_after_distributed,
               r.warms_native, r.v2_runner_no_graph_estimate, r.v2_sampler, r.counts_consumed)
              for r in RULES if not r.legacy]
    assert all(a != b for a, b in zip(fields, fields[1:], strict=False)), "two consecutive rules say the same"
    assert [r.release for r in RULES] == ["0.9.2", "0.10.0", "0.11.0", "0.11.1", "0.14.0", "0.17.0", "0.18.0",
                                          "0.20.0", "0.21.0", "0.25.0", "0.26.0", "0.27.0", "0.29.0",
                                          "0.33.0"]
    assert all(r.sources for r in RULES)


def test_torch_sort_warmup_counts_what_apply_top_k_top_p_holds_at_its_scatter():
    """0.11.1-0.16.0's sampler warm-up: per row x vocab element the bf16 logits, their fp32 copy, and at
    `scatter` the sorted fp32 logits, int64 indices, two bool masks, the fp32 cumsum and the fp32
    result (2 + 4 + 22 bytes); FlashInfer's path holds two fp32 temporaries instead (2 + 4 + 8)."""
    from kvprobe.theory.model.geometry import geometry_from_config, load_model_config
    from kvprobe.theory.vllm.memory_profile import profile_rules, sampler_warmup_bytes

    geom = geometry_from_config(load_model_config("meta-llama/Llama-3.1-8B")[0])
    hidden = 8192 * geom.hidden_size * geom.dtype_bytes
    torch_path = sampler_warmup_bytes(geom, profile_rules("0.15.1"), max_num_seqs=256, max_num_batched_tokens=8192)
    flashinfer = sampler_warmup_bytes(geom, profile_rules("0.11.0"), max_num_seqs=256, max_num_batched_tokens=8192)
    assert torch_path - hidden == 256 * geom.vocab_size * (2 + 4 + 22)
    assert flashinfer - hidden == 256 * geom.vocab_size * (2 + 4 + 8)


def test_from_0_21_0_the_warmup_also_takes_forward_native():
    """0.21.0-0.32.0 sample the dummy batch twice (gpu_model_runner.py _dummy_sampler_run, 'Also warm
    forward_native'): FlashInfer's path, then with a generator forward_native's: triton from 8 rows (its
    per-program fp32 rows on top of the same two temporaries), torch's sort below. 0.20.x samples once."""
    from kvprobe.theory.model.geometry import geometry_from_config, load_model_config
    from kvprobe.theory.vllm.memory_profile import profile_rules, sampler_warmup_bytes

    geom = geometry_from_config(load_model_config("meta-llama/Llama-3.1-8B")[0])
    hidden = 2048 * geom.hidden_size * geom.dtype_bytes

    def warmup(version: str, seqs: int) -> int:
        return sampler_warmup_bytes(geom, profile_rules(version), max_num_seqs=seqs, max_num_batched_tokens=2048,
                                    gpu_arch="sm90") - hidden

    assert profile_rules("0.21.0").warms_native and not profile_rules("0.20.2").warms_native
    assert warmup("0.21.0", 256) == 256 * geom.vocab_size * (2 + 4 + 8) + 132 * geom.vocab_size * 4  # H100: 132 SMs
    assert warmup("0.20.2", 256) == warmup("0.21.0", 256)  # triton there too: the same peak, once
    assert warmup("0.21.0", 4) == 4 * geom.vocab_size * (2 + 4 + 22)  # torch's sort under 8 rows


def test_async_scheduling_is_the_default_from_the_release_that_made_it_so():
    """config/scheduler.py `async_scheduling: bool = False` up to 0.13.0, `Field(default=None)` (on) from 0.14.0."""
    dialect = get_dialect("vllm")
    assert [dialect.async_scheduling_default(v) for v in ("0.11.0", "0.12.0", "0.13.0", "0.14.0", "0.19.0")] == \
        [False, False, False, True, True]


def test_the_hybrid_pool_rules_come_in_at_the_releases_that_read_them():
    """The free order (0.22.1 append_n alone; 0.23.0 window paths prepend; 0.24.0 BlockPool.free_blocks splits)
    and sparse retention (0.28.0 envs.py default None; 0.29.0 config/cache.py 0), each read in the wheels."""
    from kvprobe.theory.vllm.hybrid.block_pool import SPLIT, TAIL, WINDOW_SPLIT
    seen = {v: vllm_releases.window_rules(v) for v in ("0.18.1", "0.22.1", "0.23.0", "0.23.1", "0.24.0", "0.28.0",
                                                       "0.29.0", "0.33.0")}
    assert [r.free_order for r in seen.values()] == [TAIL, TAIL, WINDOW_SPLIT, WINDOW_SPLIT, SPLIT, SPLIT, SPLIT,
                                                     SPLIT]
    assert [r.sparse_retention for r in seen.values()] == [False] * 6 + [True] * 2
    assert "(0.23.x)" in seen["0.23.0"].pool_text() and "before 0.23.0" in seen["0.22.1"].pool_text()


def _watermark_ledger(version: str, watermark: float, **kw):
    # expectations/diff/vllm-watermark-shadow.yaml's shape: 1000 blocks of 16, P=512, O=256
    return build_ledger(LedgerInputs(engine="vllm", model="meta-llama/Llama-3.1-8B", engine_version=version,
                                     num_gpu_blocks_override=1000, block_size=16, max_model_len=4096,
                                     max_num_seqs=256, max_num_batched_tokens=2048, async_scheduling=True,
                                     prompt_tokens=512, output_tokens=256, watermark=watermark), **kw)


def test_the_watermark_is_read_from_0_24_0_and_refused_before():
    # 0.24.0 keeps int(0.3 x 1000) blocks free when admitting while others run (kv_cache_manager.py L163);
    # the 0.24.0 shadow measured 19.81 ± 0.37 running with it, 23.56 ± 0.89 without
    wm = _watermark_ledger("0.24.0", 0.3)
    assert wm.scheduler_config.watermark == 0.3 and wm.admission.limit == pytest.approx(19.84, abs=0.3)
    assert ("watermark", "300 blocks (0.3 x 1000) kept free when a request is admitted while others are "
                         "scheduled (vLLM 0.24.0 on)") in wm.release_rules
    assert _watermark_ledger("0.24.0", 0.0).admission.limit == pytest.approx(24.13, abs=0.3)
    # 0.23.0 has no such flag: `vllm serve` exits with argparse's error (read on the 0.23.0 shadow, exit code 2)
    refused = _watermark_ledger("0.23.0", 0.3, explain_refusal=True)
    assert refused.admission is None and "vllm: error: unrecognized arguments: --watermark 0.3" in refused.refusal
    with pytest.raises(ConfigError, match="vLLM 0.23.0 has no --watermark"):
        _watermark_ledger("0.23.0", 0.3)
    assert _watermark_ledger("0.23.0", 0.0).admission.limit == pytest.approx(24.13, abs=0.3)


def _llama_24gib(version: str, **flags):
    flags.setdefault("gpu_memory_bytes", 24 * 2**30)
    return build_ledger(LedgerInputs(engine="vllm", engine_version=version, model="meta-llama/Llama-3.1-8B",
                                     max_model_len=8192, prompt_tokens=512, output_tokens=256, **flags))


def test_a_defaulted_max_num_seqs_is_lowered_to_a_smaller_token_budget_from_0101():
    # 0.10.1's engine/arg_utils.py L1709-1712 and 0.33.0's L3232-3234: min(default, max_num_batched_tokens)
    # when max_num_seqs was not given; 0.10.0 (L1652-1654) and 0.9.2 take the default (256 on 24 GiB), and
    # config.py L2474-2478 refuses a budget below it
    for version in ("0.10.1", "0.11.0", "0.33.0"):
        assert _llama_24gib(version, max_num_batched_tokens=128).capacity.max_running == 128
    for version in ("0.9.2", "0.10.0"):
        with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(128\) must be greater than or equal to "
                                              r"max_num_seqs \(256\)"):
            _llama_24gib(version, max_num_batched_tokens=128)
    # both given: refused by every release
    with pytest.raises(ConfigError, match="must be greater than or equal to max_num_seqs"):
        _llama_24gib("0.33.0", max_num_batched_tokens=128, max_num_seqs=256)


def test_kv_cache_memory_bytes_is_a_flag_from_0102():
    # config/cache.py L116 (0.10.2); 0.10.1.1 has no such field, and its argument parser refuses the flag
    with pytest.raises(ConfigError, match="vLLM 0.10.1 has no --kv-cache-memory-bytes"):
        _llama_24gib("0.10.1", kv_cache_memory_bytes=4 * 2**30)
    assert _llama_24gib("0.10.2", kv_cache_memory_bytes=4 * 2**30).capacity.num_blocks == 4 * 2**30 // (16 * 131072)


def test_0340_reserves_at_full_utilisation_and_leaves_its_measured_pool_unmodelled():
    """0.34.0's extensible KV cache (config/cache.py L395, config/vllm.py L3180-3268): on by default on a CUDA
    GPU, off when the pool is given; utilisation 1.0 unless given (config/cache.py L494-501); the pool it
    measures after warm-up is not predicted (V16). Off, 0.33.0's rules at 0.92 size it, in 64-token blocks
    (config/cache.py L185)."""
    h100 = dict(gpu_memory_bytes=int(79.19 * 2**30))
    on = _llama_24gib("0.34.0", **h100)
    assert on.budget.fraction == 1.0 and on.budget.source == "reservation" and on.admission is None
    assert len(on.not_modelled) == 1 and on.not_modelled[0].startswith("not modelled since vLLM 0.34.0: the extensible")
    assert on.capacity.block_size == 64
    off = _llama_24gib("0.34.0", enable_extensible_kv_cache=False, **h100)
    old = _llama_24gib("0.33.0", **h100)
    assert off.budget.fraction == old.budget.fraction == 0.92 and off.admission is not None
    assert off.budget.kv_pool_bytes == old.budget.kv_pool_bytes  # the same bytes, in blocks four times larger
    assert (off.capacity.block_size, old.capacity.block_size) == (64, 16)
    assert off.capacity.num_blocks == old.budget.kv_pool_bytes // (64 * 131072)
    # a pool given turns it off (L3203, L3208): predicted as before
    given = _llama_24gib("0.34.0", num_gpu_blocks_override=2000, **h100)
    assert given.admission is not None and not given.not_modelled and given.budget.fraction == 0.92
    with pytest.raises(ConfigError, match="vLLM 0.33.0 has no --enable-extensible-kv-cache"):
        _llama_24gib("0.33.0", enable_extensible_kv_cache=True)
