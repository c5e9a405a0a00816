"""SGLang 0.5.23's KV pools for hybrid models: which layers it treats as sliding-window or
recurrent, and how it splits the memory budget between pools.

Files and lines are in the released wheel (`sglang/srt/...`):

* Layer split (`configs/model_config.py`): a model is *hybrid SWA* when its architecture is in
  `is_hybrid_swa_model`'s list (L2651-2697; GptOssForCausalLM via SWA_SINK_ARCHS L88-96,
  Llama4ForConditionalGeneration) and `--disable-hybrid-swa-memory` is off (L1213-1218). Gemma 2/3
  turn it off themselves (arg_groups/model_overrides/gemma2_gemma3.py), and Mistral is not in
  the list: both get one full pool over every layer. `get_hybrid_layer_ids` (L2700-2712): Llama 4
  windows every layer but each 4th ((i + 1) % 4, whatever `no_rope_layers` says); gpt-oss reads
  `layer_types`. The window size the scheduler uses: gpt-oss `sliding_window - 1`
  (models/gpt_oss.py L131-132), otherwise `attention_chunk_size` (model_runner_components/
  load_model_utils.py L144-157).
* Recurrent layers (Qwen3-Next, configs/qwen3_next.py L260-312): layer i is full attention when
  (i + 1) % `full_attention_interval` == 0, else Gated DeltaNet; a state slot holds, per GDN
  layer, a conv state (conv_dim/tp, kernel-1) in bfloat16 (SGLANG_MAMBA_CONV_DTYPE) and a
  recurrent state (v_heads/tp, v_dim, k_dim) in float32 unless the config or SGLANG_MAMBA_SSM_DTYPE
  says otherwise (configs/mamba_utils.py L47-125, L195-243).
* Pools (`model_executor/pool_configurator.py`, `mem_cache/kv_cache_configurator.py`):
  - hybrid SWA (`HybridSWAPoolConfigurator` L656-922): with F full and S window layers,
    full_tokens = page-floor(bytes / (F x b + ratio x S x b)), swa_tokens =
    page-floor(int(full_tokens x ratio)), ratio = `--swa-full-tokens-ratio` (0.8); a window pool at
    or below window + page is refused at startup (L198-216). With the radix cache off and
    `--max-running-requests` set, the window pool is instead sized from the worst case of those
    requests (`SWARequestCapPoolConfigurator` L924-1046).
  - recurrent (`_handle_max_mamba_cache` L3229-3409, inside `_profile_available_bytes`): slots =
    `--max-mamba-cache-size`, else `--max-running-requests` when the radix cache is off, else
    int((rest x r / (1 + r) - per_slot) / per_slot) with r = `--mamba-full-memory-ratio` (0.9);
    (slots + 1) x per_slot leaves the budget, the rest becomes the full-attention pool over the
    full layers only (`DefaultPoolConfigurator` L219-654). max_running_requests is capped at
    slots // slots-per-request (`resolve_max_num_reqs` L3119-3172; 1 without the radix cache,
    3 + 2 tracking slots with the default extra_buffer strategy and overlap, L3062-3088).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import ModelGeometry, kv_bytes_per_token
from kvprobe.theory.model.sizes import DTYPE_BYTES, GIB

HYBRID_SWA_ARCHS = ("GptOssForCausalLM", "Llama4ForConditionalGeneration")  # of those kvprobe models
SWA_OFF_ARCHS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
MAMBA_ARCHS = ("Qwen3NextForCausalLM",)
DEFAULT_SWA_FULL_TOKENS_RATIO = 0.8  # arg_groups/fields/schedule.py L150-162 (fallback)
DEFAULT_MAMBA_FULL_MEMORY_RATIO = 0.9  # arg_groups/fields/schedule.py L220-227 (fallback)
SWA_EVICTION_INTERVAL = 128  # SGLANG_SWA_EVICTION_INTERVAL (environ.py L730)
MAMBA_SLOTS_PER_REQUEST = 3  # MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO (kv_cache_configurator.py L227)


@dataclass(frozen=True)
class SglangOptions:
    tp: int = 1
    dp: int = 1
    page_size: int = 1
    swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO
    disable_hybrid_swa_memory: bool = False  # the flag; Gemma 2/3 force it on regardless
    max_mamba_cache_size: int | None = None
    mamba_full_memory_ratio: float = DEFAULT_MAMBA_FULL_MEMORY_RATIO
    disable_radix_cache: bool = False
    max_running_requests: int | None = None
    chunked_prefill_size: int = 8192
    disable_overlap_schedule: bool = False
    # "extra_buffer" (the default where the platform supports it) or "no_buffer"
    mamba_radix_cache_strategy: str = "extra_buffer"
    mamba_ssm_dtype: str | None = None  # --mamba-ssm-dtype; None = the config's, else float32


@dataclass(frozen=True)
class SglangLayout:
    """How SGLang splits the layers; `pool` is "full", "hybrid_swa" or "mamba"."""

    pool: str
    full_layer_ids: tuple[int, ...]
    swa_layer_ids: tuple[int, ...] = ()
    mamba_layer_ids: tuple[int, ...] = ()
    sliding_window_size: int | None = None
    conv_shape: tuple[int, int] | None = None  # per GDN layer, this rank
    temporal_shape: tuple[int, int, int] | None = None
    conv_dtype: str = "bfloat16"
    ssm_dtype: str = "float32"
    note: str = ""

    @property
    def mamba_cache_per_req(self) -> int:
        """Mamba2CacheParams.mamba_cache_per_req (configs/mamba_utils.py L116-125)."""
        if not self.mamba_layer_ids:
            return 0
        per_layer = math.prod(self.conv_shape) * DTYPE_BYTES[self.conv_dtype] + \
            math.prod(self.temporal_shape) * DTYPE_BYTES[self.ssm_dtype]
        return per_layer * len(self.mamba_layer_ids)


def _arch(cfg: dict) -> str:
    archs = cfg.get("architectures") or [""]
    return archs[0]


def sglang_layout(cfg: dict, geom: ModelGeometry, opts: SglangOptions | None = None) -> SglangLayout:
    """The layer split SGLang's ModelConfig derives from this config.json (`cfg`, top level)."""
    opts = opts or SglangOptions()
    n = geom.num_layers
    arch = _arch(cfg)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    everything = tuple(range(n))
    if arch in MAMBA_ARCHS:
        every = text.get("full_attention_interval") or 4
        full = tuple(i for i in everything if (i + 1) % every == 0)
        mamba = tuple(i for i in everything if (i + 1) % every != 0)
        g = geom.layers.linear
        if g is None:
            raise ConfigError("a Qwen3-Next config without Gated DeltaNet keys", key="linear_num_value_heads")
        groups = g.num_k_heads
        if groups % opts.tp:  # extra_groups_for_head_shards: not modelled
            raise ConfigError(f"linear_num_key_heads {groups} not divisible by tp={opts.tp}", key="tp")
        conv = ((g.head_v_dim * g.num_v_heads + 2 * groups * g.head_k_dim) // opts.tp, g.conv_kernel - 1)
        temporal = (g.num_v_heads // opts.tp, g.head_v_dim, g.head_k_dim)
        ssm = opts.mamba_ssm_dtype or text.get("mamba_ssm_dtype") or "float32"
        return SglangLayout("mamba", full, mamba_layer_ids=mamba, conv_shape=conv,
                            temporal_shape=temporal, ssm_dtype=ssm,
                            note=f"full_attention_interval {every}")
    if arch in HYBRID_SWA_ARCHS and not opts.disable_hybrid_swa_memory:
        if arch == "Llama4ForConditionalGeneration":
            swa = tuple(i for i in everything if (i + 1) % 4 != 0)
            window = text.get("attention_chunk_size")
            if not window:
                raise ConfigError("SGLang windows Llama 4 by attention_chunk_size; it is not set",
                                  key="attention_chunk_size")
        else:
            types = text.get("layer_types") or []
            swa = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
            window = geom.layers.sliding_window - 1  # models/gpt_oss.py L131-132
        full = tuple(i for i in everything if i not in set(swa))
        return SglangLayout("hybrid_swa", full, swa_layer_ids=swa, sliding_window_size=window)
    note = ""
    if geom.layers.hybrid:
        note = ("hybrid SWA memory is off for Gemma 2/3 (model override)" if arch in SWA_OFF_ARCHS
                else "--disable-hybrid-swa-memory" if arch in HYBRID_SWA_ARCHS
                else f"{arch or 'this model'} is not a hybrid-SWA architecture in SGLang 0.5.23")
    return SglangLayout("full", everything, note=note)


@dataclass(frozen=True)
class SglangPools:
    layout: SglangLayout
    max_total_num_tokens: int  # the full-attention pool (`sglang:max_total_num_tokens`)
    swa_tokens: int | None  # the window pool (`sglang:max_total_num_tokens_swa`)
    mamba_slots: int | None  # max_mamba_cache_size
    max_running_requests: int
    full_bytes_per_token: int  # all full layers
    swa_bytes_per_token: int  # all window layers
    kv_bytes: int | None  # the bytes the token pools were sized from (after the mamba share)


def _page_floor(x: int, page: int) -> int:
    return x // page * page


def _swa_request_cap(window: int, opts: SglangOptions) -> int:
    """compute_swa_request_cap (pool_configurator.py L924-968), no speculative decoding."""
    per_request = window + SWA_EVICTION_INTERVAL + opts.page_size + opts.page_size
    reqs = max(1, opts.max_running_requests // opts.dp)
    in_flight = 1 if opts.disable_overlap_schedule else 2
    return per_request * reqs + in_flight * opts.chunked_prefill_size + opts.page_size


def mamba_slots_per_request(opts: SglangOptions) -> int:
    """`_calculate_mamba_ratio` (kv_cache_configurator.py L3062-3088), SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK off."""
    if opts.disable_radix_cache:
        return 1
    if opts.mamba_radix_cache_strategy == "extra_buffer":
        return MAMBA_SLOTS_PER_REQUEST + (1 if opts.disable_overlap_schedule else 2)
    return MAMBA_SLOTS_PER_REQUEST


def _mamba_slots(rest_gb: float | None, per_req: int, opts: SglangOptions) -> tuple[int, float | None]:
    """(slots, rest after the mamba pool, in GiB) — `_handle_max_mamba_cache` without spec decoding."""
    if opts.max_mamba_cache_size is not None:
        slots = opts.max_mamba_cache_size // opts.dp
    elif opts.disable_radix_cache and opts.max_running_requests is not None:
        slots = max(1, opts.max_running_requests // opts.dp)
    elif rest_gb is None:
        raise ConfigError("without a GPU budget the mamba pool needs --max-mamba-cache-size (or "
                          "--max-running-requests with --disable-radix-cache)", key="max_mamba_cache_size")
    else:
        r = opts.mamba_full_memory_ratio
        budget = rest_gb * r / (1 + r) * GIB
        slots = int((budget - per_req) // per_req)
    if slots <= 0:
        raise ConfigError(f"Not enough GPU memory for hybrid (mamba/linear-attention) state cache. "
                          f"Computed max_mamba_cache_size={slots}", key="max_mamba_cache_size")
    if rest_gb is None:
        return slots, None
    return slots, rest_gb - (slots + 1) * per_req / GIB


def _profiled(lay: SglangLayout, kv_bytes: int, full_b: int, swa_b: int, cap_mode: bool,
              opts: SglangOptions) -> tuple[int, int | None]:
    """(full, swa) tokens from a byte budget: each configurator's `calculate_pool_sizes`."""
    page = opts.page_size
    if lay.pool != "hybrid_swa":  # DefaultPoolConfigurator L637-647
        return _page_floor(kv_bytes // full_b, page), None
    if cap_mode:  # SWARequestCapPoolConfigurator L1005-1032
        swa = math.ceil(_swa_request_cap(lay.sliding_window_size, opts) / page) * page
        return _page_floor(int((kv_bytes - swa * swa_b) // full_b), page), swa
    full = _page_floor(int(kv_bytes // (full_b + opts.swa_full_tokens_ratio * swa_b)), page)  # L907-916
    return full, _page_floor(int(full * opts.swa_full_tokens_ratio), page)


def _from_max_tokens(lay: SglangLayout, tokens: int, cap_mode: bool, opts: SglangOptions):
    """(full, swa) from a token cap: each configurator's `calculate_pool_sizes_from_max_tokens`."""
    page = opts.page_size
    full = _page_floor(tokens, page)
    if lay.pool != "hybrid_swa":
        return full, None
    if cap_mode:  # L1034-1042
        swa = math.ceil(_swa_request_cap(lay.sliding_window_size, opts) / page) * page
        return full, min(swa, tokens)
    return full, _page_floor(int(full * opts.swa_full_tokens_ratio), page)


def sglang_pools(cfg: dict, geom: ModelGeometry, *, context_len: int, rest_bytes: int | None = None,
                 max_total_tokens: int | None = None, kv_cache_dtype: str = "auto",
                 opts: SglangOptions | None = None) -> SglangPools:
    """The pools SGLang sizes from `rest_bytes` (what `_profile_available_bytes` holds before the
    mamba share: free memory after the weights minus the non-static slack) and/or the
    `--max-total-tokens` cap (`config_from_budget` L3192-3227: the cap re-derives the pools from
    the token count only when it is below the profiled pool)."""
    opts = opts or SglangOptions()
    lay = sglang_layout(cfg, geom, opts)
    if lay.pool == "mamba" and not opts.disable_radix_cache and opts.mamba_radix_cache_strategy == "no_buffer":
        _validate_no_buffer(opts)
    b = kv_bytes_per_token(geom, kv_cache_dtype=kv_cache_dtype, tp=opts.tp).per_layer_main
    full_b, swa_b = b * len(lay.full_layer_ids), b * len(lay.swa_layer_ids)
    slots = None
    rest_gb = None if rest_bytes is None else rest_bytes / GIB
    if lay.pool == "mamba":
        slots, rest_gb = _mamba_slots(rest_gb, lay.mamba_cache_per_req, opts)
    kv_bytes = None if rest_gb is None else int(rest_gb * GIB)
    cap_mode = (lay.pool == "hybrid_swa" and opts.disable_radix_cache and opts.chunked_prefill_size > 0
                and opts.max_running_requests is not None)  # SWARequestCapPoolConfigurator.is_applicable
    full = swa = None
    if kv_bytes is not None:
        full, swa = _profiled(lay, kv_bytes, full_b, swa_b, cap_mode, opts)
    if max_total_tokens is not None and (full is None or max_total_tokens < full):
        full, swa = _from_max_tokens(lay, max_total_tokens, cap_mode, opts)
    if full is None:
        raise ConfigError("the GPU memory is needed to size the KV pool (give --gpu-memory or "
                          "--max-total-tokens)", key="gpu_memory")
    if full <= 0:
        raise ConfigError("Not enough memory. Please try to increase --mem-fraction-static.")
    if swa is not None and not cap_mode and lay.sliding_window_size + opts.page_size >= swa:
        raise ConfigError(f"SWA pool ({swa} tokens) cannot hold even one request: the prefill admission "
                          f"floor is sliding_window_size ({lay.sliding_window_size}) + page_size "
                          f"({opts.page_size}). Increase --swa-full-tokens-ratio or the total KV budget.")
    return SglangPools(lay, full, swa, slots, _max_running_requests(full, context_len, slots, opts),
                       full_b, swa_b, kv_bytes)


def _validate_no_buffer(opts: SglangOptions) -> None:
    """SGLang's own refusals of the radix cache's no_buffer strategy (arg_groups/mamba_hook.py
    `validate_mamba_no_buffer` L155-163), in its words."""
    if opts.page_size not in (1, None):
        raise ConfigError("no_buffer only supports page_size=1.", key="page_size")
    if not opts.disable_overlap_schedule:
        raise ConfigError("no_buffer do not support overlap schedule. Try to set disable_overlap_schedule=True.",
                          key="disable_overlap_schedule")


def _max_running_requests(tokens: int, context_len: int, slots: int | None, opts: SglangOptions) -> int:
    """`resolve_max_num_reqs` (kv_cache_configurator.py L3119-3172), per DP worker."""
    if opts.max_running_requests is not None:
        mrr = min(max(1, opts.max_running_requests // opts.dp), tokens // 2)
    else:
        mrr = min(max(min(int(tokens / context_len * 512), 4096), 2048), tokens // 2)
    if slots is not None:
        mrr = min(mrr, slots // mamba_slots_per_request(opts))
        if mrr <= 0:
            raise ConfigError("Hybrid (mamba/linear-attention) state cache is too small to serve any "
                              f"requests. max_mamba_cache_size={slots}", key="max_mamba_cache_size")
    return mrr
