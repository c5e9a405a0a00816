"""vLLM's memory profile, release by release: how `Worker.determine_available_memory` turns the GPU's
total memory into the KV pool in each release kvprobe has read, and which term moved when.

    available = requested - (weights + torch peak increase + non-torch increase) [- CUDA-graph estimate]

Every release measures the same terms on the GPU; what changed between releases is what is counted
and what is subtracted. The rules are keyed by the release that changed them, found by reading every
final release from 0.11.0 to 0.33.0 (and their patch releases): the snapshot after NCCL init (0.11.0),
FlashInfer's sampler made opt-in, torch's sort path by default (0.11.1), requested rounded up (0.14.0),
the triton top-k/top-p kernel (0.17.0), the CUDA-graph estimate logged (0.18.0), then subtracted with
utilisation 0.92 (0.20.0), FlashInfer's sampler on by default again (0.21.0), dense models on the V2 model
runner, which estimates no CUDA-graph memory (0.25.0 to 0.28.0; estimated again in 0.29.0) and warms its
sampler on greedy dummy requests (no top-k/top-p; 0.26.0 on, no fp32 copy of the logits). Each rule names the engine
file and line it comes from (docs/ledger.md has the table). A version takes the rules of the newest
release at or below it that changed one.

0.27.0 measures the same sum another way (`memory_profiling`, utils/mem_utils.py L317-326: the free
memory consumed since the init snapshot plus the torch peak above what is still allocated, instead of
weights + torch peak increase + non-torch increase); with PyTorch's own allocator the two differ only
by blocks it keeps reserved after `empty_cache`, so it is no new rule here.

0.33.0 keeps kvprobe's own estimates (`legacy=True`: `vllm.budget.estimate_vllm_*`), on which the
expectations and shadow checks rest; the sampler warm-up below is in its source too (see
docs/ledger.md, "what remains").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvprobe.errors import ConfigError
from kvprobe.releases import version_tuple
from kvprobe.theory.model.geometry import ModelGeometry
from kvprobe.theory.model.sizes import MIB

# Streaming multiprocessors of the GPU family (`--gpu-arch`): the triton top-k/top-p kernel keeps one
# vocab-wide fp32 row per program, min(next_pow2(min(SMs, rows)), SMs) of them (v1/sample/ops/
# topk_topp_triton.py apply_top_k_top_p_triton, 0.19.0 L1013-1019). H100 SXM 132, B200 148. The kernel reads
# the device's own count (num_compute_units(logits.device.index): 0.17.1 L992-1000), so a card known by name
# with its SMs (spec/gpus.py, `gpu_sms`) takes those: an RTX 3090's 82.
SMS_BY_ARCH = {"sm90": 132, "sm100": 148}


@dataclass(frozen=True)
class ProfileRules:
    """What one vLLM release counts and subtracts when it sizes the KV pool."""

    release: str  # the release these rules were read in
    gpu_memory_utilization: float  # CacheConfig default
    requested_ceil: bool  # requested = ceil(total x util) (v1/worker/utils.py request_memory); else total x util
    cudagraph: str  # "none": not profiled; "logged": estimated and printed, not subtracted; "subtracted"
    sampler: str  # the dummy sampler's top-k/top-p path: "flashinfer" | "torch" (sort) | "triton"
    snapshot_after_distributed: bool  # the init snapshot follows NCCL init: the context is not counted
    warms_native: bool = False  # the warm-up samples a second time with a generator: forward_native's path too
    v2_runner_no_graph_estimate: bool = False  # dense models default to the V2 runner, whose estimate is 0
    # The V2 runner's dummy sampler (its models only): "fp32_copy" the model-dtype logits and their fp32 copy;
    # "logits" the logits alone (no copy for its greedy dummy requests); "" not the V2 runner's (V1's rule)
    v2_sampler: str = ""
    v2_runs_every_model: bool = False  # 0.29.0: every model takes the V2 runner (not only the dense ones)
    # 0.27.0: the non-KV memory is the free memory consumed since the init snapshot (weights, non-torch and
    # torch's cached blocks), the graphs profiled after the window (`non_torch_bytes`)
    counts_consumed: bool = False
    legacy: bool = False  # kvprobe's own 0.33.0 estimates, unchanged
    sources: tuple[str, ...] = ()

    def requested(self, total: int, fraction: float) -> int:
        """The memory the release asks for (v1/worker/utils.py request_memory)."""
        return math.ceil(total * fraction) if self.requested_ceil else int(total * fraction)

    def describe(self) -> str:
        graph = {"none": "no CUDA-graph estimate", "logged": "CUDA-graph estimate logged, not subtracted",
                 "subtracted": "CUDA-graph estimate subtracted"}[self.cudagraph]
        requested = "ceil(total x util)" if self.requested_ceil else "total x util"
        terms = "kvprobe's estimates" if self.legacy else f"sampler warm-up via {self.sampler}"
        if self.v2_runner_no_graph_estimate:
            graph += " (0 for dense models: the V2 runner's)"
        return f"vLLM {self.release} rules: requested = {requested}; {graph}; {terms}"


_V0210 = ProfileRules(
    "0.21.0", 0.92, requested_ceil=True, cudagraph="subtracted", sampler="flashinfer",
    snapshot_after_distributed=True, warms_native=True,
    sources=("envs.py L726-730: VLLM_USE_FLASHINFER_SAMPLER unset = True; v1/sample/ops/topk_topp_sampler.py "
             "L39-49: FlashInfer top-k/top-p where the GPU supports it (flashinfer a CUDA requirement: "
             "0.23.0 L29); same through 0.32.0 (envs.py L878-882)",
             "v1/worker/gpu_model_runner.py L5743-5765 _dummy_sampler_run: the sampler again with "
             "generators={0: ...} ('Also warm forward_native'; not in 0.20.2, in every release to 0.33.0), "
             "which forward_cuda hands to forward_native (topk_topp_sampler.py L143-150): apply_top_k_top_p, "
             "triton from 8 rows, torch's sort below (L305-315)"))
# 0.21.0's rules but for the V2 runner's graph estimate, and 0.29.0 back to 0.21.0's
_V0250 = replace(
    _V0210, release="0.25.0", v2_runner_no_graph_estimate=True,
    sources=("config/vllm.py L557-575 _is_default_v2_model_runner_model: a generate model that is neither "
             "hybrid nor attention-free takes the V2 model runner unless it is MoE (a few MoE architectures "
             "too, DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES); 0.24.0 (L550-552) only the listed architectures",
             "v1/worker/gpu/model_runner.py L680-682 profile_cudagraph_memory: 'return 0' (V2), so "
             "gpu_worker.py (L483) subtracts no graph estimate for these models (0.25.0 wheel; 0.25.1 "
             "the same files); the same in 0.26.0 (L705-707, "
             "config/vllm.py L621), 0.27.1 (L749-751, L658) and 0.28.0 (L843-845, L712)",
             "v1/worker/gpu/model_runner.py L629-640 _dummy_sampler_run: compute_logits, then the sampler on "
             "InputBatch.make_dummy's requests, whose sampling states are the defaults (sample/states.py L22-34: "
             "temperature 0, top_k = vocab, top_p = 1: greedy, neither top-k nor top-p; 'the sampler may skip "
             "top_k, top_p'); sample/sampler.py L157 apply_sampling_params copies the logits to fp32 "
             "unconditionally, and gumbel_sample holds (rows, blocks) only: the model-dtype logits + one fp32 "
             "copy, no V1 top-k/top-p path"),
    v2_sampler="fp32_copy")
# 0.26.0: the V2 sampler keeps the logits' dtype (no fp32 copy for the greedy dummy requests)
_V0260 = replace(
    _V0250, release="0.26.0", v2_sampler="logits",
    sources=(*_V0250.sources[:2],
             "v1/worker/gpu/sample/sampler.py (0.26.0) apply_sampling_params: 'The ops below upcast to fp32 "
             "internally, so the input dtype is kept and mutated in place', a clone only for raw logprobs "
             "(the dummy requests ask none); 0.27.1 (L159, L200-216) and 0.28.0 (L196) copy to fp32 only "
             "when _requires_logits_processing, false for the default (greedy) states: the V2 dummy sampler "
             "holds the model-dtype logits alone (model_runner.py _dummy_sampler_run: 0.26.0 L654-665, "
             "0.27.1 L683-694, 0.28.0 L771-782)"))
# 0.27.0: total_consumed = before_create.free - after_profile.free (utils/mem_utils.py L317-326), and
# profile_cudagraph_memory after the window (v1/worker/gpu_worker.py L500-517); 0.26.0 measured
# non_torch_increase with the graph profile inside it (L484-513)
_V0270 = replace(
    _V0260, release="0.27.0", counts_consumed=True,
    sources=(*_V0260.sources, "utils/mem_utils.py L317-326 (0.27.0): total_consumed = before_create.free - "
             "after_profile.free; v1/worker/gpu_worker.py L500-526: profile_cudagraph_memory after the window"))
_V0290 = replace(
    _V0210, release="0.29.0", v2_sampler="logits", v2_runs_every_model=True, counts_consumed=True,
    sources=("v1/worker/gpu/model_runner.py L896-898 profile_cudagraph_memory: the V2 runner estimates "
             "graph memory (_profile_cudagraph_memory), as V1 does; otherwise 0.21.0's rules",
             "config/vllm.py L645-676 use_v2_model_runner: every model takes the V2 runner unless "
             "_get_v2_model_runner_unsupported_features (L2539-2611: stock torch.compile, TP sequence "
             "parallelism, ngram speculation, DBO, elastic EP, custom logits processors, ...) names one",
             "v1/worker/gpu/model_runner.py L832-843 _dummy_sampler_run, sample/sampler.py L61, L218-219: "
             "needs_logits_processing is all False for the dummy requests, no fp32 copy: the logits alone"))


RULES: tuple[ProfileRules, ...] = (
    ProfileRules(  # known for its logs and admission; its memory profile not read: kvprobe's estimates
        "0.9.2", 0.9, requested_ceil=True, cudagraph="subtracted", sampler="flashinfer",
        snapshot_after_distributed=False, legacy=True, sources=("config/cache.py: gpu_memory_utilization = 0.9",)),
    ProfileRules(  # read in 0.10.1.1; 0.10.0, 0.10.1 and 0.10.2 compute the same (the lines below are 0.10.1.1's:
        # determine_available_memory 0.10.0 L229-247, 0.10.2 L259-280 with its new --kv-cache-memory-bytes
        # branch; memory_profiling textually the same 0.9.2-0.10.2; 0.11.0 first snapshots after NCCL)
        "0.10.0", 0.9, requested_ceil=False, cudagraph="none", sampler="flashinfer",
        snapshot_after_distributed=False,
        sources=("config/cache.py L43: gpu_memory_utilization = 0.9",
                 "v1/worker/gpu_worker.py L174-176: init snapshot, requested = total x util, then "
                 "init_worker_distributed_environment (L192): NCCL init is counted as non-torch",
                 "v1/worker/gpu_worker.py L240-258: available = requested - non_kv_cache_memory; no graph term",
                 "v1/sample/ops/topk_topp_sampler.py L33-50: FlashInfer top-k/top-p on CUDA "
                 "(VLLM_USE_FLASHINFER_SAMPLER None = on in V1) when installed: the `flashinfer` extra "
                 "(METADATA), in the official image; without it torch's sort path peaks higher (not modelled)")),
    ProfileRules(
        "0.11.0", 0.9, requested_ceil=False, cudagraph="none", sampler="flashinfer",
        snapshot_after_distributed=True,
        sources=("config/cache.py L43: gpu_memory_utilization = 0.9",
                 "v1/worker/gpu_worker.py L169-184: init_worker_distributed_environment, then the snapshot "
                 "and requested = total x util (no ceil); no graph term",
                 "v1/sample/ops/topk_topp_sampler.py L46: FlashInfer top-k/top-p on CUDA (the `flashinfer` "
                 "extra, as 0.10.1.1)")),
    ProfileRules(
        "0.11.1", 0.9, requested_ceil=False, cudagraph="none", sampler="torch",
        snapshot_after_distributed=True,
        sources=("envs.py L647-651: VLLM_USE_FLASHINFER_SAMPLER unset = None, and "
                 "v1/sample/ops/topk_topp_sampler.py L34-47: FlashInfer only on opt-in (=1), else forward_native",
                 "v1/sample/ops/topk_topp_sampler.py L152-191 apply_top_k_top_p: the sort path "
                 "(sort, masks, softmax/cumsum, scatter); same through 0.16.0 (L243-282)")),
    ProfileRules(
        "0.14.0", 0.9, requested_ceil=True, cudagraph="none", sampler="torch",
        snapshot_after_distributed=True,
        sources=("v1/worker/gpu_worker.py L234: requested_memory = request_memory(...); "
                 "v1/worker/utils.py L253-260: math.ceil(total x util) (0.13.0 gpu_worker.py L241: no ceil)",)),
    ProfileRules(
        "0.17.0", 0.9, requested_ceil=True, cudagraph="none", sampler="triton",
        snapshot_after_distributed=True,
        sources=("v1/sample/ops/topk_topp_sampler.py L245-255 apply_top_k_top_p: the triton kernel "
                 "(v1/sample/ops/topk_topp_triton.py, new in 0.17.0) from 8 rows, torch's sort below; "
                 "FlashInfer still opt-in",)),
    ProfileRules(
        "0.18.0", 0.9, requested_ceil=True, cudagraph="logged", sampler="triton",
        snapshot_after_distributed=True,
        sources=("v1/worker/gpu_worker.py L398-399: profile_cudagraph_memory() estimated and logged; L413-415: "
                 "subtracted only with VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS (envs.py L1635-1636, default 0)",
                 "read again in 0.19.0: config/cache.py L41; gpu_worker.py L263-283 (request_memory, "
                 "v1/worker/utils.py L408: ceil), L376-421; envs.py L1654; gpu_model_runner.py L5721-5795 "
                 "profile_run -> _dummy_sampler_run (L5556): max_num_seqs rows, top-k and top-p")),
    ProfileRules(
        "0.20.0", 0.92, requested_ceil=True, cudagraph="subtracted", sampler="triton",
        snapshot_after_distributed=True,
        sources=("config/cache.py L66: gpu_memory_utilization = 0.92",
                 "envs.py L1724: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS default 1: the estimate is "
                 "subtracted (v1/worker/gpu_worker.py determine_available_memory)")),
    _V0210,
    _V0250,
    _V0260,
    _V0270,
    _V0290,
    ProfileRules(
        "0.33.0", 0.92, requested_ceil=True, cudagraph="subtracted", sampler="flashinfer",
        snapshot_after_distributed=True, legacy=True,
        sources=("config/cache.py L215: gpu_memory_utilization = 0.92",
                 "v1/worker/gpu_worker.py L702-757, envs.py L2219-2221: graph estimate subtracted by default",
                 "envs.py L887-891: FlashInfer sampler on by default (kvprobe's estimates do not use it)")),
)


def profile_rules(version: str) -> ProfileRules:
    """The rules of the newest read release at or below `version`; older than all: the oldest."""
    mine = version_tuple(version)
    below = [r for r in RULES if version_tuple(r.release) <= mine]
    return below[-1] if below else RULES[0]


# MoE architectures that 0.25.0-0.28.0 still give the V2 runner (config/vllm.py
# DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES, 0.25.0 L68-74), by config.json model_type
V2_MOE_MODEL_TYPES = frozenset({"deepseek_v2", "qwen2_moe", "granitemoe"})


def graph_estimate_is_zero(rules: ProfileRules, geom: ModelGeometry) -> bool:
    """True where the release runs this model on the V2 model runner, whose `profile_cudagraph_memory`
    returns 0 (ProfileRules 0.25.0's sources): a model that is not a linear-attention/Mamba hybrid, and
    dense or one of the listed MoE architectures. Sliding-window models are not vLLM's `is_hybrid`.
    The V2 runner's unsupported features (ngram speculation, prefill context parallelism, stock
    torch.compile) fall back to V1; the ledger models none of them."""
    return rules.v2_runner_no_graph_estimate and runs_v2_runner(rules, geom)


def runs_v2_runner(rules: ProfileRules, geom: ModelGeometry) -> bool:
    """The V2 model runner's models under these rules (0.25.0-0.28.0, config/vllm.py
    _is_default_v2_model_runner_model; graph_estimate_is_zero says which). 0.29.0 defaults every model to
    it (config/vllm.py L645-676 use_v2_model_runner, unless a feature is unsupported: none the ledger
    takes a flag for)."""
    if rules.v2_runs_every_model:
        return True
    if not rules.v2_runner_no_graph_estimate or geom.layers.count("linear"):
        return False
    return not geom.moe or geom.model_type in V2_MOE_MODEL_TYPES


def sampler_warmup_bytes(geom: ModelGeometry, rules: ProfileRules, *, max_num_seqs: int,
                         max_num_batched_tokens: int, gpu_arch: str = "sm90", pp: int = 1,
                         gpu_sms: int | None = None) -> int:
    """Torch peak of profile_run's sampler warm-up (`_dummy_sampler_run`), the activation peak of most
    models at max_num_seqs 1024: one row per dummy request (`_dummy_run`: min(tokens, max_num_seqs)).

    Live at the peak, per row x vocab element: the model-dtype logits (compute_logits), their fp32
    copy (v1/sample/sampler.py `logits.to(torch.float32)`), and the sampling path's temporaries:
    triton (0.17-0.20) two fp32, softmax probs + random_sample's exponential `q = torch.empty_like(probs)`
    (v1/sample/ops/topk_topp_sampler.py); FlashInfer (0.10, 0.11.0, 0.21-0.32) two fp32, top_k_mask_logits
    + softmax; torch's sort (0.11.1-0.16, `apply_top_k_top_p` at its `scatter`) the sorted fp32 logits,
    their int64 indices, the top-k and top-p bool masks, the fp32 softmax/cumsum and the scattered fp32
    result (the sort's own workspace is not modelled). The triton path adds its cached per-program
    rows; the forward's hidden states (max_num_batched_tokens rows, profile_run keeps them until the
    sampler returns) are live throughout. From 0.21.0 the warm-up samples twice, the second time with a
    generator, which takes forward_native (triton, or torch's sort under 8 rows) whatever the first path:
    the peak is the larger of the two calls (the first call's temporaries are freed when it returns).
    With PP the sampler runs on the last rank, which also holds
    the received hidden states and residual of max_num_batched_tokens
    (`_dummy_run` make_empty_intermediate_tensors, 0.19.0 L5437-5446); the pool is the smallest over
    the ranks (the executor takes the minimum), so this rank's peak is the one that counts.
    The V2 model runner's models (0.25.0-0.28.0, and every model from 0.29.0: `rules.v2_sampler`) sample
    greedy dummy requests: the logits (and 0.25.0's fp32 copy of them) and the hidden states only, the
    forward the larger term."""
    rows = min(max_num_seqs, max_num_batched_tokens)
    hidden = max_num_batched_tokens * geom.hidden_size * geom.dtype_bytes
    if rules.v2_sampler and runs_v2_runner(rules, geom):  # V2's greedy dummy requests: no top-k/top-p path
        per_element = geom.dtype_bytes + (4 if rules.v2_sampler == "fp32_copy" else 0)
        return rows * geom.vocab_size * per_element + hidden + (2 * hidden if pp > 1 else 0)
    sms = gpu_sms or SMS_BY_ARCH.get(gpu_arch, SMS_BY_ARCH["sm90"])
    peak = _sampling_path_bytes(rules.sampler, rows, geom, sms)
    if rules.warms_native:  # the second call's forward_native: the larger of the two paths is the peak
        peak = max(peak, _sampling_path_bytes("triton" if rows >= 8 else "torch", rows, geom, sms))
    return peak + hidden + (2 * hidden if pp > 1 else 0)


def _sampling_path_bytes(path: str, rows: int, geom: ModelGeometry, sms: int) -> int:
    """One sampler call on `rows` dummy requests down one top-k/top-p path (sampler_warmup_bytes says what)."""
    per_element = geom.dtype_bytes + 4 + (4 + 8 + 1 + 4 + 1 + 4 if path == "torch" else 4 + 4)
    peak = rows * geom.vocab_size * per_element
    if path == "triton" and rows >= 8:  # apply_top_k_top_p: triton from 8 rows
        programs = min(sms, rows)
        peak += min(1 << (programs - 1).bit_length(), sms) * geom.vocab_size * 4
    return peak


# Non-torch memory counted by releases whose init snapshot follows CUDA and NCCL init: not the CUDA
# context (it is in the snapshot), only what the driver, NCCL and the kernels' modules add during
# load and profiling. Its size is not in vLLM's source (driver and NCCL allocations); where it is
# measured is: the window closes after profile_run alone up to 0.17.x (0.17.1 gpu_worker.py L386-393),
# and from 0.18.0 after profile_cudagraph_memory too, which captures graphs on a scratch KV cache and
# frees them (0.18.1 L384-399, 0.19.1 L366-391, 0.26.0 L484-506), skipped under --enforce-eager and a
# no-op where the V2 runner estimates nothing (graph_estimate_is_zero); from 0.27.0 the term is the
# free memory consumed since the snapshot less the weights (ProfileRules.counts_consumed). The corpus
# of real start-up logs (tests/data/gpu_logs/) prints the term: one rank that profiles graphs in the
# window, 0.24-0.27 GiB (vLLM 0.19.0 on H100, 9 runs); one that does not, 0.08 GiB (0.26.0's V2 runner
# on an A40, 4 runs); 0.27.1's consumed memory less the weights, 0.30 GiB (an RTX 4090, no graphs);
# 2.07-2.21 GiB at TP 2 and 4 (7 runs: NCCL's NVLink-switch buffers). Override with
# estimates["other_bytes"].
NON_TORCH_ONE_RANK = 256 * MIB
NON_TORCH_ONE_RANK_NO_GRAPHS = 80 * MIB
NON_TORCH_TP = 2112 * MIB  # 2.06 GiB


def non_torch_bytes(rules: ProfileRules, *, tp: int, pp: int, graphs_profiled: bool = True) -> int | None:
    """The non-torch increase these rules count, or None where kvprobe's own estimate stands.

    Every release read takes its init snapshot after the CUDA context exists (gpu_worker.py init_device:
    set_device and empty_cache first), so one rank without NCCL counts a small increase in all of them:
    larger where the profiling window also captures CUDA graphs (`graphs_profiled`). Where the snapshot
    precedes init_worker_distributed_environment (0.10.1.1) NCCL's buffers are counted too, and their
    size is the transport's (NVLink switch, PCIe, Ray across nodes: not in vLLM's source): kvprobe's own
    estimate stands there."""
    if rules.legacy:
        return None
    if tp == 1:  # from 0.27.0 the term holds torch's cached blocks too (the RTX 4090 logs: 0.30 GiB, no graphs)
        return NON_TORCH_ONE_RANK if graphs_profiled or rules.counts_consumed else NON_TORCH_ONE_RANK_NO_GRAPHS
    return NON_TORCH_TP if rules.snapshot_after_distributed else None


def graphs_profiled(rules: ProfileRules, geom: ModelGeometry, *, enforce_eager: bool) -> bool:
    """Does the release's profiling window capture CUDA graphs (`non_torch_bytes`)? From 0.18.0, unless
    --enforce-eager or the V2 runner's estimate is nothing."""
    return rules.cudagraph != "none" and not enforce_eager and not graph_estimate_is_zero(rules, geom)


# vLLM requests total x gpu_memory_utilization and subtracts only its own process's increase (0.18.1 and 0.33.0
# v1/worker/utils.py request_memory, gpu_worker.py): other processes' memory moves no pool there; it enters
# only the start-up check "Free memory on device ... is less than desired GPU memory utilization" (below).
# That check was read in 0.18.1 and 0.19.1 (v1/worker/utils.py L403-420), 0.23.0 (L405-422), 0.29.0 (L517-538) and
# 0.33.0 (L716-745, the same without externally held weights); releases before 0.18 were not read for it.
FREE_MEMORY_CHECK_FROM = "0.18.0"
FREE_MEMORY_REFUSAL = "ValueError: Free memory on device"
FREE_MEMORY_NOT_MODELLED = (
    "the free memory at start enters vLLM only through its start-up check (free >= requested), read from "
    f"{FREE_MEMORY_CHECK_FROM} on; for this release give the card's total alone")


def free_memory_refusal(version: str, *, total: int, free: int, fraction: float, requested: int) -> str | None:
    """vLLM's start-up refusal when the free memory its init snapshot reads is under the requested memory
    (request_memory: `if init_snapshot.free_memory < requested_memory: raise ValueError(...)`, the figures
    as format_gib prints them, round(x / GiB, 2)); None when it starts. The snapshot is taken after the
    process's own CUDA context: `free` is that figure (the one the refusal prints). ConfigError for a
    release whose check was not read."""
    if version_tuple(version) < version_tuple(FREE_MEMORY_CHECK_FROM):
        raise ConfigError(FREE_MEMORY_NOT_MODELLED, key="gpu_free_memory")
    if free >= requested:
        return None
    gib = 1 << 30
    return (f"{FREE_MEMORY_REFUSAL} ({round(free / gib, 2)}/{round(total / gib, 2)} GiB) on startup "
            f"is less than desired GPU memory utilization ({fraction}, {round(requested / gib, 2)} GiB). "
            "Decrease GPU memory utilization or reduce GPU memory used by other processes.")
