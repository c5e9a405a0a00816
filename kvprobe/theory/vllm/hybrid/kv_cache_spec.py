"""vLLM 0.33.0's KV cache for hybrid models: the per-layer specs a GPU model runner registers and
how the planner groups them into one block pool (the capacity line and "maximum concurrency").

Every rule below is vLLM 0.33.0's own, file and line in the released wheel (`vllm/...`):

* Layer specs (`v1/kv_cache_interface.py`): full attention -> `FullAttentionSpec`; a windowed
  layer -> `SlidingWindowSpec(sliding_window=config value)` (layers/attention/attention.py
  L624-673); Llama 4's RoPE layers -> `ChunkedLocalAttentionSpec` (layers/attention/
  chunked_local_attention.py L119-128); a Gated DeltaNet layer -> `MambaSpec` with a conv state
  `(kernel-1, conv_dim/tp)` and a recurrent state `(v_heads/tp, v_dim, k_dim)`
  (layers/mamba/mamba_utils.py L272-293, layers/mamba/abstract.py L72-91).
* Page of one block of one layer = `block_size x kv_heads x (head + head_v) x dtype bytes`
  (AttentionSpec.page_size_bytes L596-601); a Mamba page = the state bytes, padded to the
  attention page (MambaSpec.page_size_bytes L1120-1129).
* What one request can hold in a group, at most (`max_memory_usage_bytes`): full
  `cdiv(max_model_len, B)` blocks (L643-648); sliding `cdiv(min(window - 1 + in_flight,
  max_model_len), B) + 1` (L918-944: blocks that leave the window are freed, but tokens in flight
  keep theirs); chunked `cdiv(min(chunk + in_flight, max_model_len), B)` (L864-881); Mamba 2
  blocks in "align" mode plus one per prefill checkpoint, else 1 (L1135-1141). `in_flight =
  max_concurrent_batches x max_num_batched_tokens`, 2 batches with async scheduling
  (config/vllm.py L586-608).
* Grouping (`v1/core/kv_cache_planning.py` get_kv_cache_groups L1113-1200): one group when every
  layer has the same spec; otherwise layers are bucketed by spec, and every bucket is cut into
  groups of `group_size` layers, the smallest bucket's layer count (the largest's when it is less
  than 1.5x the smallest), padding the last group of a bucket (L416-556). All groups share one
  block pool; one block is `max over groups of the group's pages` bytes (L574-605).
* With the hybrid KV cache manager off (`--disable-hybrid-kv-cache-manager`, or for chunked local
  attention when VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0, config/vllm.py L2236-2255;
  the variable defaults to 1 in 0.33.0, envs.py L1931-1933), windowed and chunked layers are
  planned as full attention (`_promote_local_kv_cache_specs` L744-816).
* Capacity (`v1/core/kv_cache_utils.py` L1061-1128): max concurrency = num_blocks / the sum over
  groups of a request's blocks at max_model_len; tokens = int(concurrency x max_model_len).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import ModelGeometry, kv_bytes_per_token
from kvprobe.theory.model.layers import CHUNKED, FULL, LINEAR, SLIDING
from kvprobe.theory.model.sizes import DTYPE_BYTES, cdiv, format_gib

FULL_SPEC, SLIDING_SPEC = "FullAttentionSpec", "SlidingWindowSpec"
CHUNKED_SPEC, MAMBA_SPEC = "ChunkedLocalAttentionSpec", "MambaSpec"
_SPEC_OF = {FULL: FULL_SPEC, SLIDING: SLIDING_SPEC, CHUNKED: CHUNKED_SPEC, LINEAR: MAMBA_SPEC}

# FlashAttention's kernels take any multiple of 16 tokens (reference/vllm.md §1.5); the window
# layers then run the primary block size unsplit (attention.py L641-663) and the hybrid Mamba
# alignment starts from 16 (platforms/interface.py L1066-1082).
FLASH_ATTN_BLOCK_MULTIPLE = 16
# FlashInfer's GDN prefill (chosen on Hopper, qwen_gdn_linear_attn.py L148-240) exports mid-prefill
# states on a 64-token grid (v1/attention/backends/gdn_attn.py L34) and then holds one more state
# block per request (qwen_gdn_linear_attn.py L739-750).
FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64
GDN_MAMBA_TYPE = "gdn_attn"  # MambaAttentionBackendEnum.GDN_ATTN (gdn/base.py L50-51)
_TORCH_DTYPE = {"auto": None, "bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
                "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class VllmLayerSpec:
    """One layer's `KVCacheSpec` as vLLM's GPU model runner registers it; the field names are the
    spec classes' own, so `kvprobe.targets.shadow.vllm.kvspec.to_vllm_spec` builds the real objects from them."""

    name: str
    spec: str  # FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | MambaSpec
    block_size: int
    cache_dtype: str  # the --kv-cache-dtype value (attention layers)
    dtype: str = ""  # torch dtype name of the attention cache
    num_kv_heads: int = 0
    head_size: int = 0
    head_size_v: int = 0
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    shapes: tuple[tuple[int, ...], ...] = ()  # Mamba states
    dtypes: tuple[str, ...] = ()
    page_size_padded: int | None = None
    mamba_type: str = ""
    mamba_cache_mode: str = "none"
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None  # the prefix-cache grid: the Mamba block size

    @property
    def page_size_bytes(self) -> int:
        if self.spec == MAMBA_SPEC:
            raw = sum(math.prod(s) * DTYPE_BYTES[d] for s, d in zip(self.shapes, self.dtypes, strict=True))
        else:
            raw = self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v) * \
                DTYPE_BYTES[self.dtype]
        return max(raw, self.page_size_padded or 0)

    def blocks_per_request(self, max_model_len: int, in_flight: int) -> int:
        """Blocks one request can hold in this layer's group (max_memory_usage_bytes / page)."""
        if self.spec == FULL_SPEC:
            return cdiv(max_model_len, self.block_size)
        if self.spec == SLIDING_SPEC:
            return cdiv(min(self.sliding_window - 1 + in_flight, max_model_len), self.block_size) + 1
        if self.spec == CHUNKED_SPEC:
            return cdiv(min(self.attention_chunk_size + in_flight, max_model_len), self.block_size)
        if self.mamba_cache_mode == "align":
            return 2 + self.num_prefill_checkpoint_blocks
        return 1


@dataclass(frozen=True)
class VllmOptions:
    """The engine settings the hybrid plan depends on (vLLM 0.33.0 defaults on a CUDA GPU)."""

    cache_dtype: str = "auto"  # --kv-cache-dtype
    block_size: int = 16  # --block-size, or the backend's choice (16 for FlashAttention)
    tp: int = 1
    max_num_batched_tokens: int = 2048
    async_scheduling: bool = True  # on by default on CUDA (config/vllm.py L1685-1719)
    pp: int = 1
    # None = vLLM decides: on, except chunked local attention with the env var below at 0
    hybrid_kv_cache_manager: bool | None = None
    # VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE, "1" by default (envs.py L1931-1933)
    allow_chunked_local_attn_with_hybrid_kv_cache: bool = True
    enable_prefix_caching: bool = True  # default on for hybrid models (config/model.py L2277-2279)
    mamba_cache_dtype: str = "auto"  # --mamba-cache-dtype
    mamba_ssm_cache_dtype: str = "auto"  # --mamba-ssm-cache-dtype
    gdn_prefill_backend: str = "flashinfer"  # Hopper; "triton" elsewhere (no checkpoint blocks)

    @property
    def in_flight_tokens(self) -> int:
        """VllmConfig.max_in_flight_tokens (config/vllm.py L586-608)."""
        batches = (2 if self.pp <= 1 else self.pp + 1) if self.async_scheduling else self.pp
        return batches * self.max_num_batched_tokens

    @property
    def mamba_cache_mode(self) -> str:
        """MambaModelConfig (models/config.py L750-787): "align" with prefix caching, else "none"."""
        return "align" if self.enable_prefix_caching else "none"


def hybrid_kv_cache_manager(geom: ModelGeometry, opts: VllmOptions) -> tuple[bool, str]:
    """Whether vLLM plans window/chunk layers as such (config/vllm.py L2223-2294), and why."""
    chunked = geom.layers.attention_chunk_size is not None and geom.layers.count(CHUNKED) > 0
    if opts.hybrid_kv_cache_manager is False:
        return False, "--disable-hybrid-kv-cache-manager"
    if chunked and not opts.allow_chunked_local_attn_with_hybrid_kv_cache:
        if opts.hybrid_kv_cache_manager:
            raise ConfigError("Hybrid KV cache manager was explicitly enabled but is not supported in "
                              "this configuration (chunked local attention with "
                              "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0)",
                              key="hybrid_kv_cache_manager")
        return False, "chunked local attention (VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0)"
    return True, "default"


def _torch_dtype(cache_dtype: str, geom: ModelGeometry) -> str:
    if cache_dtype not in _TORCH_DTYPE:
        raise ConfigError(f"expected one of {', '.join(_TORCH_DTYPE)} for a hybrid model, got "
                          f"{cache_dtype!r}", key="kv_cache_dtype")
    return _TORCH_DTYPE[cache_dtype] or geom.dtype


def _gdn_state(geom: ModelGeometry, opts: VllmOptions) -> tuple[tuple, tuple]:
    """(shapes, dtypes) of one GDN layer's state on one TP rank, conv in "SD" layout
    (mamba_utils.py L164-168, L272-293); dtypes per mamba_utils.py L97-130 ("auto": the model
    dtype for conv, the conv dtype for the recurrent state)."""
    g = geom.layers.linear
    tp = opts.tp
    if g.conv_dim % tp or g.num_v_heads % tp:
        raise ConfigError(f"Gated DeltaNet heads do not divide by tp={tp}", key="tp")
    conv = _TORCH_DTYPE.get(opts.mamba_cache_dtype) or geom.dtype
    ssm = conv if opts.mamba_ssm_cache_dtype == "auto" else _TORCH_DTYPE[opts.mamba_ssm_cache_dtype]
    shapes = ((g.conv_kernel - 1, g.conv_dim // tp), (g.num_v_heads // tp, g.head_v_dim, g.head_k_dim))
    return shapes, (conv, ssm)


def hybrid_block_size(geom: ModelGeometry, opts: VllmOptions) -> tuple[int, int | None]:
    """(attention block size, padded Mamba page) after `_align_hybrid_block_size`
    (platforms/interface.py L940-1135): the attention page must hold a Mamba state, so the block
    grows to the smallest multiple of the kernel alignment whose page does."""
    if geom.layers.count(LINEAR) == 0:
        return opts.block_size, None
    shapes, dtypes = _gdn_state(geom, opts)
    mamba_page = sum(math.prod(s) * DTYPE_BYTES[d] for s, d in zip(shapes, dtypes, strict=True))
    attn_1 = max(1, geom.num_kv_heads // opts.tp) * (geom.head_dim + geom.v_head_dim) * \
        DTYPE_BYTES[_torch_dtype(opts.cache_dtype, geom)]
    align = max(FLASH_ATTN_BLOCK_MULTIPLE, opts.block_size)
    if opts.mamba_cache_mode == "align" and opts.gdn_prefill_backend == "flashinfer":
        align = math.lcm(align, FLASHINFER_GDN_CHECKPOINT_ALIGNMENT)
    block = align * cdiv(mamba_page, align * attn_1)
    block = FLASH_ATTN_BLOCK_MULTIPLE * cdiv(block, FLASH_ATTN_BLOCK_MULTIPLE)
    block = max(block, opts.block_size)
    page = block * attn_1
    return block, (page if page != mamba_page else None)


def vllm_layer_specs(geom: ModelGeometry, opts: VllmOptions | None = None, *,
                     max_model_len: int | None = None) -> list[VllmLayerSpec]:
    """One spec per KV-holding layer, in layer order, as a CUDA GPU's model runner registers them
    (before the planner's own promotion when the hybrid manager is off). Layer names are
    `model.layers.{i}.self_attn.attn` / `model.layers.{i}.linear_attn`: only their order and
    distinctness matter to the planner. `max_model_len` is the Mamba block size when prefix
    caching is off (models/config.py L786-787)."""
    opts = opts or VllmOptions()
    if opts.pp > 1 and geom.layers.hybrid:
        raise ConfigError("pipeline parallelism of a hybrid model (per-stage group projection) is "
                          "not modelled", key="pp")
    if geom.attention == "mla" and geom.layers.hybrid:
        raise ConfigError("MLA with window/linear layers is not modelled", key="layer_types")
    dtype = _torch_dtype(opts.cache_dtype, geom)
    block, mamba_page = hybrid_block_size(geom, opts)
    kv = kv_bytes_per_token(geom, kv_cache_dtype=opts.cache_dtype, tp=opts.tp)
    lk = geom.layers
    specs = []
    for i, kind in enumerate(lk.kinds):
        if kind == LINEAR:
            shapes, dtypes = _gdn_state(geom, opts)
            ckpt = int(opts.mamba_cache_mode == "align" and opts.gdn_prefill_backend == "flashinfer")
            specs.append(VllmLayerSpec(
                f"model.layers.{i}.linear_attn", MAMBA_SPEC,
                block if opts.mamba_cache_mode == "align" else _mamba_len(max_model_len), opts.cache_dtype,
                shapes=shapes, dtypes=dtypes, page_size_padded=mamba_page, mamba_type=GDN_MAMBA_TYPE,
                mamba_cache_mode=opts.mamba_cache_mode, num_prefill_checkpoint_blocks=ckpt,
                # get_mamba_prefill_checkpoint_grid without --prefix-match-unit (mamba/abstract.py L116-129)
                prefill_checkpoint_alignment=block if ckpt else None))
            continue
        specs.append(VllmLayerSpec(
            f"model.layers.{i}.self_attn.attn", _SPEC_OF[kind], block, opts.cache_dtype, dtype,
            kv.kv_heads_per_rank, geom.head_dim, geom.v_head_dim,
            sliding_window=lk.sliding_window if kind == SLIDING else None,
            attention_chunk_size=lk.attention_chunk_size if kind == CHUNKED else None))
    return specs


def _mamba_len(max_model_len: int | None) -> int:
    if not max_model_len:
        raise ConfigError("max_model_len is the Mamba block size without prefix caching",
                          key="max_model_len")
    return max_model_len


def promote_local_specs(specs: list[VllmLayerSpec]) -> list[VllmLayerSpec]:
    """`unify_hybrid_kv_cache_specs` / `_promote_local_kv_cache_specs` (kv_cache_planning.py
    L744-816, L853-877): with the hybrid manager off, window and chunk layers next to full layers
    allocate like full attention; any other mix (a Mamba state next to attention) cannot be
    unified and vLLM refuses to start."""
    kinds = {s.spec for s in specs}
    if FULL_SPEC in kinds and kinds & {SLIDING_SPEC, CHUNKED_SPEC}:
        specs = [VllmLayerSpec(s.name, FULL_SPEC, s.block_size, s.cache_dtype, s.dtype, s.num_kv_heads,
                               s.head_size, s.head_size_v) if s.spec in (SLIDING_SPEC, CHUNKED_SPEC)
                 else s for s in specs]
    if len({s.spec for s in specs}) > 1:
        raise ConfigError("Failed to promote local KV cache specs to one unified type.",
                          key="hybrid_kv_cache_manager")
    return specs


@dataclass(frozen=True)
class VllmGroup:
    """One KV cache group: layers sharing a block table."""

    spec: str
    layers: tuple[str, ...]
    block_size: int
    page_size_bytes: int  # one layer's page
    blocks_per_request: int  # at max_model_len (the capacity line's divisor term)
    padding_layers: int = 0  # slots of the group's block left unused (vLLM warns about them)

    @property
    def bytes_per_block(self) -> int:
        return len(self.layers) * self.page_size_bytes


def group_specs(specs: list[VllmLayerSpec], *, max_model_len: int, in_flight: int) -> list[VllmGroup]:
    """`get_kv_cache_groups` for these spec kinds (kv_cache_planning.py L1113-1200, L416-556)."""
    if len({s.page_size_bytes for s in specs}) > 1:
        raise ConfigError("layers with different page sizes (packed or padded KV layouts) are not "
                          "modelled", key="layer_types")
    buckets: dict[tuple, list[VllmLayerSpec]] = {}
    for s in specs:  # spec equality: FullAttentionSpec layers merge whatever their window/chunk
        key = (s.spec, s.block_size) if s.spec == FULL_SPEC else (s.spec, s.block_size,
                                                                 s.sliding_window, s.attention_chunk_size)
        buckets.setdefault(key, []).append(s)
    groups_of = list(buckets.values())
    if len(groups_of) == 1:
        size = len(specs)
    else:
        small, large = min(len(b) for b in groups_of), max(len(b) for b in groups_of)
        size = large if large < small * 1.5 else small
    groups = []
    for bucket in groups_of:
        n = cdiv(len(bucket), size)
        for i in range(n):
            members = bucket[i::n]
            first = members[0]
            groups.append(VllmGroup(first.spec, tuple(m.name for m in members), first.block_size,
                                    first.page_size_bytes,
                                    first.blocks_per_request(max_model_len, in_flight),
                                    size - len(members)))
    return groups


@dataclass(frozen=True)
class VllmKVPlan:
    """The planner's result for one worker, and the startup capacity line."""

    groups: tuple[VllmGroup, ...]
    block_size: int  # the attention block size (hybrid Mamba models enlarge it)
    bytes_per_block: int
    num_blocks: int  # includes the null block, as logged
    max_model_len: int
    blocks_per_request: int  # sum over groups at max_model_len
    max_concurrency: float
    kv_tokens: int  # "GPU KV cache size: N tokens"
    hybrid_kv_cache_manager: bool
    hma_reason: str
    in_flight_tokens: int
    specs: tuple[VllmLayerSpec, ...] = field(default=(), repr=False)
    # vLLM's start-up refusal text (vllm_kv_plan(refuse=False)), and the longest max_model_len
    # the pool holds (the estimate in that text; 0 when not even one token fits)
    refusal: str | None = None
    largest_max_model_len: int = 0

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1


def _needed_bytes(groups: list[VllmGroup], bytes_per_block: int) -> int:
    return bytes_per_block * sum(g.blocks_per_request for g in groups)


def _estimate_max_model_len(specs, available: int, max_model_len: int, in_flight: int) -> int:
    """`_estimate_max_model_len_from_groups` (L1288-1334): binary search of the longest request
    whose blocks fit `available` bytes; 0 when not even one token does."""
    def fits(length: int) -> bool:
        groups = group_specs(specs, max_model_len=length, in_flight=in_flight)
        bpb = max(g.bytes_per_block for g in groups) if groups else 0
        return _needed_bytes(groups, bpb) <= available
    if not fits(1):
        return 0
    lo, hi, best = 1, max_model_len, 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def plan_layout(geom: ModelGeometry, opts: VllmOptions, max_model_len: int
                ) -> tuple[list[VllmLayerSpec], list[VllmGroup], int, bool, str]:
    """(specs, groups, bytes per block, hybrid manager on, why): the layout, before any memory."""
    hma, why = hybrid_kv_cache_manager(geom, opts)
    specs = vllm_layer_specs(geom, opts, max_model_len=max_model_len)
    if not hma:
        specs = promote_local_specs(specs)
    if not specs:
        raise ConfigError("the model has no KV cache layers", key="layer_types")
    groups = group_specs(specs, max_model_len=max_model_len, in_flight=opts.in_flight_tokens)
    bpb = max(g.bytes_per_block for g in groups)  # _get_kv_cache_bytes_per_block (L574-605)
    return specs, groups, bpb, hma, why


def vllm_kv_plan(geom: ModelGeometry, *, max_model_len: int, available_bytes: int | None = None,
                 num_gpu_blocks_override: int | None = None, opts: VllmOptions | None = None,
                 auto_fit: bool = False, refuse: bool = True) -> VllmKVPlan:
    """What `get_kv_cache_configs` + `get_kv_cache_capacity` compute for one worker. Where vLLM
    would refuse to start this raises its message; with `refuse=False` the plan is returned with
    `refusal` set (a ledger still shows every number behind it)."""
    opts = opts or VllmOptions()
    specs, groups, bpb, hma, why = plan_layout(geom, opts, max_model_len)
    inflight = opts.in_flight_tokens
    if num_gpu_blocks_override is not None:  # the planner re-plans with N x bytes (L1510-1533)
        available_bytes = num_gpu_blocks_override * bpb
    if available_bytes is None:
        raise ConfigError("the KV pool needs available bytes or --num-gpu-blocks-override",
                          key="gpu_memory")
    check = available_bytes - bpb  # the null block (L1535-1544)
    refusal = None
    fit = _estimate_max_model_len(specs, check, max_model_len, inflight) if check > 0 else 0
    try:
        if auto_fit:  # _auto_fit_max_model_len (L1337-1410)
            if fit <= 0:
                raise ConfigError("Cannot auto-fit max_model_len: not enough GPU memory available to "
                                  "serve even a single token. Try increasing `gpu_memory_utilization`.")
            max_model_len = min(max_model_len, fit)
            groups = group_specs(specs, max_model_len=max_model_len, in_flight=inflight)
        _check_fits(specs, groups, bpb, check, max_model_len, inflight)
    except ConfigError as err:
        if refuse:
            raise
        refusal = str(err)
    num_blocks = max(0, available_bytes // bpb) if num_gpu_blocks_override is None else num_gpu_blocks_override
    per_request = sum(g.blocks_per_request for g in groups)
    concurrency = num_blocks / per_request
    attn_block = next((s.block_size for s in specs if s.spec != MAMBA_SPEC), specs[0].block_size)
    return VllmKVPlan(tuple(groups), attn_block, bpb, num_blocks, max_model_len, per_request,
                      concurrency, int(concurrency * max_model_len), hma, why, inflight, tuple(specs),
                      refusal, fit)


def _check_fits(specs, groups, bpb: int, check: int, max_model_len: int, inflight: int) -> None:
    """`_check_enough_kv_cache_memory` (L50-87) with the group-aware need (L1253-1285)."""
    if check <= 0:
        raise ConfigError("No available memory for the cache blocks. Try increasing "
                          "`gpu_memory_utilization` when initializing the engine.")
    needed = _needed_bytes(groups, bpb)
    if needed <= check:
        return
    est = _estimate_max_model_len(specs, check, max_model_len, inflight)
    est_msg = (f"Based on the available memory, the estimated maximum model length is {est}. "
               if est > 0 else "")
    raise ConfigError(
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV cache "
        f"memory ({format_gib(check)} GiB). {est_msg}Try increasing `gpu_memory_utilization` (which also "
        f"controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing "
        f"the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more "
        f"details.")
