"""Memory budget -> KV pool, as SGLang sizes it: a formula, then a measurement.

With total memory T and weights W, K = T * mem_fraction_static - W, where the default fraction is
f = (T - R) / T and R, the memory SGLang keeps outside the static pools, is a formula of the card
and the flags (python/sglang/srt/arg_groups/memory_hook.py `handle_gpu_memory_settings`), not a
measurement; the pool is then what the loaded weights leave of T * f
(model_executor/kv_cache_configurator.py `_profile_available_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from kvprobe.errors import ConfigError
from kvprobe.releases import KNOWN_VERSIONS, SGLANG, SGLANG_DEFAULT_VERSION, normalize_version
from kvprobe.theory.model.geometry import KVBytes, ModelGeometry
from kvprobe.theory.model.sizes import GIB, MIB
from kvprobe.theory.sglang.memory_profile import cuda_graph_reserves_dropped, memory_rules, release_key
from kvprobe.theory.sglang.pools import SglangLayout, SglangOptions, SglangPools, sglang_layout, sglang_pools
from kvprobe.theory.sglang.releases import MAX_PREFILL_TOKENS
from kvprobe.units import format_bytes


def sglang_hybrid_layout(geom: ModelGeometry, model_config: dict | None, opts: SglangOptions | None,
                         pp: int = 1) -> SglangLayout | None:
    """How SGLang pools a hybrid model (sglang/pools.sglang_layout), or None for one uniform pool.
    Gemma 2/3, Mistral and --disable-hybrid-swa-memory pool every layer as full: the uniform budget
    is then SGLang's own. A window model gets a full and a window pool; Qwen3-Next a full pool over
    its full-attention layers and a recurrent-state (Mamba) pool. Refused naming the key: a hybrid
    pool across pipeline stages."""
    if not geom.layers.hybrid:
        return None
    if model_config is None or opts is None:
        raise ConfigError(f"{geom.name} has {geom.layers.describe()} layers: SGLang's budget needs the model's "
                          "config.json and the hybrid options (sglang_budget(model_config=, hybrid_opts=))",
                          key=geom.layers.key or "layer_types")
    lay = sglang_layout(model_config, geom, opts)
    if lay.pool == "full":
        return None
    if pp > 1:
        raise ConfigError("SGLang's hybrid sliding-window pools are sized for one pipeline stage only", key="pp")
    return lay



def sglang_gpu_tier(gpu_mem_mib: int | None, *, tp: int = 1) -> tuple[int, int]:
    """(chunked_prefill_size, decode cuda-graph max_bs) by `memory.total` in MiB.

    SGLang 0.5.23 `arg_groups/memory_hook.py::handle_gpu_memory_settings` L89-180.
    """
    if gpu_mem_mib is None:
        return 4096, 160
    if gpu_mem_mib < 20 * 1024:
        return 2048, 8
    if gpu_mem_mib < 35 * 1024:
        return 4096, 48 if tp < 4 else 160
    if gpu_mem_mib < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if gpu_mem_mib < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


# Prefill cuda-graph capture sizes (0.5.23 `arg_groups/cuda_graph_hook.py`
# `generate_prefill_cuda_graph_batch_sizes`): token counts on a grid that coarsens as it grows,
# every size up to max_bs. Segments are (first, last, step); the open last segment runs to max_bs.
_PREFILL_GRID = ((4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256))
_PREFILL_TAIL = (4608, 512)


def sglang_prefill_graph_sizes(max_bs: int) -> list[int]:
    sizes = [s for first, last, step in _PREFILL_GRID for s in range(first, last + 1, step)]
    start, step = _PREFILL_TAIL
    sizes += list(range(start, max_bs + 1, step))
    return [s for s in sizes if s <= max_bs]


def sglang_reserved_mib(gpu_mem_mib: int | None, *, chunked_prefill_size: int, tp: int = 1, pp: int = 1,
                        mla: bool = False, cuda_graph_max_bs: int, prefill_graphs: bool = True,
                        decode_graphs: bool = True, max_prefill_tokens: int = MAX_PREFILL_TOKENS,
                        prefill_graph_max_bs: int | None = None) -> float:
    """MiB SGLang keeps outside mem_fraction_static (memory_hook.py L281-328, L357-399)."""
    if chunked_prefill_size > 0:
        activation_tokens = max(chunked_prefill_size, 2048)
    else:
        activation_tokens = max(max_prefill_tokens, 2048)
    reserved = 512 + activation_tokens * 1.5 + tp * pp / 8 * 1024
    if decode_graphs:
        reserved += cuda_graph_max_bs * 2
    if prefill_graphs:
        if mla:
            reserved += 1.5 * 1024
        else:
            cap = chunked_prefill_size if prefill_graph_max_bs is None else prefill_graph_max_bs
            reserved += len(sglang_prefill_graph_sizes(cap)) * 8
    if gpu_mem_mib is not None and gpu_mem_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return reserved


def sglang_default_mem_fraction_static(gpu_mem_mib: int | None, *, chunked_prefill_size: int, tp: int = 1,
                                       pp: int = 1, mla: bool = False, cuda_graph_max_bs: int,
                                       prefill_graphs: bool = True, **kw) -> float:
    if gpu_mem_mib is None:
        return 0.95
    reserved = sglang_reserved_mib(gpu_mem_mib, chunked_prefill_size=chunked_prefill_size, tp=tp, pp=pp,
                                   mla=mla, cuda_graph_max_bs=cuda_graph_max_bs,
                                   prefill_graphs=prefill_graphs, **kw)
    return round((gpu_mem_mib - reserved) / gpu_mem_mib, 3)


def sglang_default_max_running_requests(max_total_num_tokens: int, context_len: int,
                                        user_value: int | None = None, *, dp: int = 1) -> int:
    """`kv_cache_configurator.py::resolve_max_num_reqs` (0.5.23 L3119-3172), per DP worker."""
    if user_value is not None:
        return min(max(1, user_value // dp), max_total_num_tokens // 2)
    estimated = max(min(int(max_total_num_tokens / context_len * 512), 4096), 2048)
    return min(estimated, max_total_num_tokens // 2)


def sglang_max_req_input_len(context_len: int, max_total_num_tokens: int) -> int:
    """`tp_worker.py::get_worker_info`: min(context_len - 1, pool - 1) - 5."""
    return min(context_len - 1, max_total_num_tokens - 1) - 5


def sglang_default_page_size(geom: ModelGeometry) -> int:
    """1 on CUDA (overrides.py `_page_size_default`); DSA models need 64-token pages (seed 002)."""
    return 64 if geom.indexer_layers else 1


@dataclass
class SglangBudget:
    total_bytes: int | None
    fraction: float | None  # mem_fraction_static used
    fraction_source: str  # "default formula" | "--mem-fraction-static"
    reserved_mib: float | None  # None when the fraction was given
    weights: int
    kv_pool_bytes: int | None
    kv_pool_bytes_upper: int | None
    cell_size: int
    max_total_num_tokens: int
    profiled_tokens: int | None
    page_size: int
    max_running_requests: int
    chunked_prefill_size: int
    cuda_graph_max_bs: int
    max_req_input_len: int
    context_len: int
    estimates: dict[str, int] = field(default_factory=dict)
    refusal: str | None = None  # SGLang's start-up refusal (sglang_budget(refuse=False)): no pool at all
    # a hybrid sliding-window model's pools (sglang/pools.py); None: one pool over every layer
    pools: SglangPools | None = None
    rules: str | None = None  # the release rules applied (sglang/memory_profile.py); None: 0.5.23's formula
    rules_change: str | None = None  # what those rules' first release changed (memory_profile.py `change`)


# The first release whose hybrid pools kvprobe has read. 0.5.20 sizes them as 0.5.21 does off
# --enable-unified-memory (its default, arg_groups/fields/memory.py L80): model_executor/pool_configurator.py
# HybridSWAPoolConfigurator.calculate_pool_sizes `available_bytes // cell_size`, swa = full x ratio (0.5.20
# L552-798; 0.5.21 L571-811 changes only the unified branch: `_max_unified_full_tokens`,
# `unified_memory_pool_bytes`), SWAChunkCapPoolConfigurator's cap the same arithmetic (0.5.20 L799-916,
# 0.5.21 `compute_swa_request_cap` L812),
# kv_cache_configurator.py `_handle_max_mamba_cache` / `_calculate_mamba_ratio` / `resolve_max_num_reqs`
# the same but for names; and the window charge of admission managers/schedule_policy.py
# `_swa_budget_for_req` L781-809 is 0.5.21's `estimate_swa_kv_tokens` (mem_cache/prefill_budget.py L26-57).
# So release-changes.md S7 (#36729, the shared byte budget) reaches only --enable-unified-memory, which the
# ledger does not model; 0.5.19 and older are not read.
HYBRID_POOLS_READ_FROM = (0, 5, 20, 0)

def sglang_budget(geom: ModelGeometry, kv: KVBytes, *, weights: int, gpu_memory_bytes: int | None,
                  context_len: int, mem_fraction_static: float | None = None,
                  chunked_prefill_size: int | None = None, page_size: int | None = None,
                  max_total_tokens: int | None = None, max_running_requests: int | None = None,
                  tp: int = 1, pp: int = 1, dp: int = 1,
                  estimates: dict[str, int] | None = None, refuse: bool = True,
                  model_config: dict | None = None, hybrid_opts: SglangOptions | None = None,
                  kv_cache_dtype: str = "auto", version: str | None = None,
                  gpu_free_bytes: int | None = None, disable_piecewise_cuda_graph: bool = False,
                  disable_cuda_graph: bool = False) -> SglangBudget:
    """KV pool = F x mfs - W, F the *free* memory when SGLang starts, while the defaults (the fraction,
    chunked_prefill_size, the graph batch sizes) come from the card's total, `gpu_memory_bytes`
    (server_args.py `_handle_gpu_memory_settings(get_device_memory_capacity())`; the profile's F:
    `sglang_free_at_start`). `gpu_free_bytes` is F on a shared card; else the card is taken as
    empty (F = total) unless estimates["other_bytes"] says what else is there.
    Where SGLang would refuse to start (no memory left for the pool) this raises its message; with
    `refuse=False` the budget is returned with `refusal` set and an empty pool, so a ledger can
    show every number that leads there. A hybrid model (`model_config` and `hybrid_opts` given) is
    pooled as SGLang pools it (`sglang_hybrid_layout`): a sliding-window model's full and window
    pools come from the same byte budget (sglang/pools.sglang_pools). `version` selects that
    release's defaults (sglang/memory_profile.memory_rules): from 0.5.3 the formula above with that
    release's GPU tiers and graph terms; None, 0.5.23, or a release kvprobe has not read (run under an
    admission policy the caller named): the formula above as 0.5.23 writes it."""
    known = version is not None and normalize_version(version) in KNOWN_VERSIONS[SGLANG]
    rules = memory_rules(version) if known else None
    if rules is not None and rules.legacy:
        rules = None
    if rules is not None and geom.layers.hybrid and release_key(version) < HYBRID_POOLS_READ_FROM:
        raise ConfigError(f"SGLang {version}'s hybrid pools are not read (only 0.5.20-0.5.23's)",
                          key="engine_version")
    layout = sglang_hybrid_layout(geom, model_config, hybrid_opts, pp)
    estimates = dict(estimates or {})
    other = estimates.pop("other_bytes", 0)
    if estimates:
        raise ConfigError(f"SGLang has no estimate(s) {sorted(estimates)}; its reserve is a formula "
                          "(only other_bytes applies)", key="estimates")
    free = sglang_free_at_start(gpu_memory_bytes, gpu_free_bytes, other)
    if gpu_free_bytes is not None:
        other = gpu_memory_bytes - gpu_free_bytes  # what other processes hold, shown as other_bytes
    mib = None if gpu_memory_bytes is None else gpu_memory_bytes // MIB
    tier_cps, max_bs = sglang_gpu_tier(mib, tp=tp) if rules is None else rules.gpu_defaults(mib, tp)
    cps = tier_cps if chunked_prefill_size is None else chunked_prefill_size
    formula = rules is None or rules.fraction == "reserved-formula"
    if max_running_requests is not None and (rules is None or rules.clamp_max_bs):
        max_bs = min(max_bs, max_running_requests)  # decode max_bs capped when it was defaulted
    page = page_size or sglang_default_page_size(geom)
    reserved = None
    # whether the default fraction reserves the prefill graphs; refuses the flag where the release has none,
    # whichever way the fraction is then found
    graphs = sglang_prefill_graphs_reserved(rules, version, disable_piecewise_cuda_graph)
    if mem_fraction_static is not None:
        fraction, how = mem_fraction_static, "--mem-fraction-static"
        if not 0 < fraction < 1:
            raise ConfigError(f"expected 0 < mem_fraction_static < 1, got {fraction}",
                              key="mem_fraction_static")
    elif not formula:
        fraction = rules.default_fraction(mib, tp=tp, pp=pp)
        how = f"default, SGLang {rules.release}-{rules.until} rules"
    else:
        mla = geom.attention == "mla"
        graph_cap = min(8192, cps) if mla else cps
        if max_total_tokens is not None:
            graph_cap = min(graph_cap, max_total_tokens)
        no_prefill, no_decode = cuda_graph_reserves_dropped(None if rules is None else version) \
            if disable_cuda_graph else (False, False)
        graphs = graphs and not no_prefill
        reserved = sglang_reserved_mib(mib, chunked_prefill_size=cps, tp=tp, pp=pp, mla=mla,
                                       cuda_graph_max_bs=max_bs, prefill_graph_max_bs=graph_cap,
                                       prefill_graphs=graphs, decode_graphs=not no_decode)
        fraction = sglang_default_mem_fraction_static(
            mib, chunked_prefill_size=cps, tp=tp, pp=pp, mla=mla, cuda_graph_max_bs=max_bs,
            prefill_graph_max_bs=graph_cap, prefill_graphs=graphs, decode_graphs=not no_decode)
        how = "default formula" if rules is None else f"default formula, SGLang {rules.release}-{rules.until} rules"
        if mib is None and rules is not None:
            reserved, fraction = None, rules.no_gpu_fraction
    kv_bytes = profiled = None
    if gpu_memory_bytes is not None:
        # kv_cache_configurator.py::_profile_available_bytes, in GiB floats as SGLang does it.
        free_gb = free / GIB
        rest_gb = (free_gb - weights / GIB) - free_gb * (1 - fraction)
        if rest_gb <= 0:
            need = math.ceil((1 - (free_gb - weights / GIB) / free_gb) * 1000) / 1000
            refusal = (f"Loaded weights leave no GPU memory for the KV cache under "
                       f"--mem-fraction-static={fraction}. Raise --mem-fraction-static above "
                       f"{need:.3f} (weights {format_bytes(weights)} per rank)")
            if refuse:
                raise ConfigError(refusal)
            return SglangBudget(gpu_memory_bytes, fraction, how, reserved, weights, None, None, kv.total, 0, 0,
                                page, 0, cps, max_bs, 0, context_len, {"other_bytes": other} if other else {},
                                refusal)
        kv_bytes = int(rest_gb * GIB)
    if layout is not None:  # the full and window pools from the same bytes
        return _sglang_hybrid_budget(geom, model_config, hybrid_opts, kv_bytes, kv_cache_dtype, context_len,
                                     max_total_tokens, page, cps, max_running_requests, tp, dp,
                                     (gpu_memory_bytes, fraction, how, reserved, weights, max_bs, other))
    if kv_bytes is not None:
        profiled = kv_bytes // kv.total // page * page  # pool_configurator.calculate_pool_sizes
        tokens = profiled if max_total_tokens is None else min(profiled, max_total_tokens) // page * page
    elif max_total_tokens is not None:
        tokens = max_total_tokens // page * page
    else:
        raise ConfigError("the GPU memory is needed to size the KV pool (give --gpu-memory or "
                          "--max-total-tokens)", key="gpu_memory")
    if tokens <= 0:
        raise ConfigError(f"Not enough memory. Please try to increase --mem-fraction-static. "
                          f"Current value: mem_fraction_static={fraction}")
    mrr = sglang_default_max_running_requests(tokens, context_len, max_running_requests, dp=dp)
    return SglangBudget(gpu_memory_bytes, fraction, how, reserved, weights, kv_bytes, kv_bytes,
                        kv.total, tokens, profiled, page, mrr, cps, max_bs,
                        sglang_max_req_input_len(context_len, tokens), context_len,
                        {"other_bytes": other} if other else {}, rules=None if rules is None else rules.describe(),
                        rules_change=None if rules is None else rules.change or None)


def sglang_free_at_start(total: int | None, free: int | None, other: int = 0) -> int | None:
    """F, the free memory the profile starts from: `free` as given (the card shared), else the total less
    what estimates["other_bytes"] says holds it. Refused naming the key: a free memory without the card's
    total (SGLang's defaults are the total's), above it, or given with other_bytes (the same memory twice)."""
    if free is None:
        return None if total is None else total - other
    if total is None:
        raise ConfigError("a free GPU memory needs the card's total too (--gpu / --gpu-memory): SGLang takes "
                          "its defaults from the total and the pool from the free memory", key="gpu_free_memory")
    if free > total:
        raise ConfigError(f"expected the free memory at start ({format_bytes(free)}) at most the card's total "
                          f"({format_bytes(total)})", key="gpu_free_memory")
    if other:
        raise ConfigError("one of the free memory at start or estimates other_bytes (both say what else holds "
                          "the card)", key="gpu_free_memory")
    return free


def sglang_prefill_graphs_reserved(rules, version: str | None, disabled: bool) -> bool:
    """Whether the default fraction reserves the prefill (piecewise) cuda graphs (memory_profile.py rules:
    on by default from 0.5.10). --disable-piecewise-cuda-graph drops the reserve where the release has
    the flag (`rules.piecewise_flag`, 0.5.10-0.5.19); elsewhere SGLang's argparse rejects it, so the
    ledger refuses it naming the release (0.5.23's formula, rules None, has no such flag either)."""
    if disabled and (rules is None or not rules.piecewise_flag):
        have = "0.5.10-0.5.19 (removed in 0.5.20: --cuda-graph-backend-prefill disabled, not modelled)"
        raise ConfigError(f"SGLang {version or SGLANG_DEFAULT_VERSION} has no --disable-piecewise-cuda-graph "
                          f"(it exists in {have})", key="disable_piecewise_cuda_graph")
    if rules is None:
        return True
    return rules.prefill_graphs and not disabled


def _sglang_hybrid_budget(geom, model_config, opts, kv_bytes, kv_cache_dtype, context_len, max_total_tokens, page,
                          cps, max_running_requests, tp, dp, split) -> SglangBudget:
    """The pools SGLang sizes from the same KV bytes: full and window (HybridSWAPoolConfigurator, or
    SWARequestCapPoolConfigurator with the radix cache off and --max-running-requests), or the
    recurrent-state slots first and the full pool from the rest (_handle_max_mamba_cache)."""
    total, fraction, how, reserved, weights, max_bs, other = split
    opts = dataclasses.replace(opts, tp=tp, dp=dp, page_size=page, chunked_prefill_size=cps,
                               max_running_requests=max_running_requests)
    pools = sglang_pools(model_config, geom, context_len=context_len, rest_bytes=kv_bytes,
                         max_total_tokens=max_total_tokens, kv_cache_dtype=kv_cache_dtype, opts=opts)
    profiled = None
    if kv_bytes is not None:
        profiled = sglang_pools(model_config, geom, context_len=context_len, rest_bytes=kv_bytes,
                                kv_cache_dtype=kv_cache_dtype, opts=opts).max_total_num_tokens
    tokens = pools.max_total_num_tokens
    return SglangBudget(total, fraction, how, reserved, weights, kv_bytes, kv_bytes, pools.full_bytes_per_token,
                        tokens, profiled, page, pools.max_running_requests, cps, max_bs,
                        sglang_max_req_input_len(context_len, tokens), context_len,
                        {"other_bytes": other} if other else {}, pools=pools)
