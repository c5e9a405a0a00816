"""vLLM 0.33.0's KV cache for hybrid models: the per-layer specs a GPU model runner registers
(vllm/v1/kv_cache_interface.py, and the layers that build them) and the engine settings they
depend on.

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

How the planner groups these specs into one block pool is `kvprobe.theory.vllm.hybrid.kv_cache_planning`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import ModelGeometry, kv_bytes_per_token
from kvprobe.theory.model.layers import CHUNKED, FULL, LINEAR, SLIDING
from kvprobe.theory.model.mxfp4 import DEFAULT_GPU_ARCH
from kvprobe.theory.model.sizes import DTYPE_BYTES, cdiv

FULL_SPEC, SLIDING_SPEC = "FullAttentionSpec", "SlidingWindowSpec"
CHUNKED_SPEC, MAMBA_SPEC = "ChunkedLocalAttentionSpec", "MambaSpec"
_SPEC_OF = {FULL: FULL_SPEC, SLIDING: SLIDING_SPEC, CHUNKED: CHUNKED_SPEC, LINEAR: MAMBA_SPEC}

# FlashAttention's kernels take any multiple of 16 tokens (v1/attention/backends/flash_attn.py
# get_supported_kernel_block_sizes: MultipleOf(16)); the window
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
    # the GDN prefill kernel the layer runs (resolve_gdn_prefill_backend): FlashInfer's on a Hopper, the
    # ledger's default card; only it emits the mid-prefill states a checkpoint block holds
    gdn_prefill_backend: str = "flashinfer"
    # a GDN layer's prefill checkpoint block and its 64-token grid in "align" mode: 0.33.0 on; through 0.32.0
    # two state blocks a request, whatever the prefill backend (theory/vllm/releases.py MAMBA_CHECKPOINTS_FROM)
    prefill_checkpoints: bool = True
    # the kernel alignment a hybrid block is raised in steps of: max(16, block_size) from 0.20.2, a fixed 16
    # through 0.19.1 (theory/vllm/releases.py ALIGN_ON_GIVEN_BLOCK_FROM)
    align_on_given_block: bool = True
    # the release's in-flight rule (theory/vllm/releases.py WINDOW_IN_FLIGHT_FROM): through 0.25.1 a window
    # group's most blocks count one batch, max_num_batched_tokens, whatever the scheduling
    window_in_flight: bool = True

    @property
    def in_flight_tokens(self) -> int:
        """VllmConfig.max_in_flight_tokens (config/vllm.py L586-608); T before the release that has it."""
        if not self.window_in_flight:
            return self.max_num_batched_tokens
        batches = (2 if self.pp <= 1 else self.pp + 1) if self.async_scheduling else self.pp
        return batches * self.max_num_batched_tokens

    @property
    def mamba_cache_mode(self) -> str:
        """MambaModelConfig (models/config.py L750-787): "align" with prefix caching, else "none"."""
        return "align" if self.enable_prefix_caching else "none"


# --gdn-prefill-backend's choices (engine/arg_utils.py L1947-1953 in 0.33.0); None (auto): the platform's choice
GDN_PREFILL_BACKENDS = ("flashinfer", "triton", "cutedsl", "aiter_flydsl", "sycl")
ARCH_CAPABILITY = {"sm89": "8.9", "sm90": "9.0", "sm100": "10.0"}  # the ledger's --gpu-arch families
HOPPER = ARCH_CAPABILITY[DEFAULT_GPU_ARCH]  # where no card is declared: the ledger's default family
CAPABILITY_FORM = re.compile(r"\d+\.\d+")  # "major.minor", as deviceQuery and torch print it


def card_capability(capability: str | None, arch: str | None) -> str:
    """The card's compute capability: declared, else its family's (--gpu-arch), else HOPPER."""
    return capability or ARCH_CAPABILITY[arch or DEFAULT_GPU_ARCH]


def resolve_gdn_prefill_backend(requested: str | None, capability: str | None, head_k_dim: int | None) -> str:
    """The GDN prefill kernel vLLM 0.33.0/0.34.0 runs on a CUDA GPU of compute `capability` ("8.0"; None:
    HOPPER) when `--gdn-prefill-backend` asked for `requested` (None: auto). FlashInfer's kernel on exactly 9.0,
    or on the 10.x and 12.x families when `head_k_dim` is 128 and the CUDA runtime is 13 (the PyPI wheels of both
    releases are built for CUDA 13: their nvidia-cutlass-dsl[cu13] requirement); CuteDSL only when asked for, on
    10.x with head_k_dim 128; Triton/FLA otherwise, whatever was asked (model_executor/layers/mamba/gdn/
    qwen_gdn_linear_attn.py _resolve_gdn_prefill_backend, 0.33.0 L148-270; 0.34.0 the same for FlashInfer, its
    11.x family CuteDSL-only). kvprobe sizes CUDA GPUs: the XPU and ROCm kernels are refused as vLLM refuses
    them on one (L183-184, L237-241)."""
    if requested is not None and requested not in GDN_PREFILL_BACKENDS:
        raise ConfigError(f"expected one of {', '.join(GDN_PREFILL_BACKENDS)}, got {requested!r}",
                          key="gdn_prefill_backend")
    if requested == "sycl":
        raise ConfigError("GDN prefill backend 'sycl' is only supported on XPU.", key="gdn_prefill_backend")
    if requested == "aiter_flydsl":
        raise ConfigError("GDN prefill backend 'aiter_flydsl' was requested but it is a ROCm AITER backend and the "
                          "current platform is cuda.", key="gdn_prefill_backend")
    major, _, minor = (capability or HOPPER).partition(".")
    family, wide = int(major), head_k_dim == 128
    flashinfer = (family, minor) == (9, "0") or (family in (10, 12) and wide)
    if requested in (None, "flashinfer") and flashinfer:
        return "flashinfer"
    if requested == "cutedsl" and family == 10 and wide:
        return "cutedsl"
    return "triton"


def release_options(rules, geom: ModelGeometry, requested: str | None = None, capability: str | None = None) -> dict:
    """The VllmOptions fields a release's rules set (theory/vllm/releases.py WindowRules), and the GDN prefill
    kernel where it moves the pool (GDN layers on a release whose layer takes a checkpoint block with it): the one
    place the ledger, the emulator and the shadow worker take them. `requested`: --gdn-prefill-backend."""
    checkpoints = rules.mamba_checkpoints
    kernel = (resolve_gdn_prefill_backend(requested, capability, geom.layers.linear.head_k_dim)
              if checkpoints and geom.layers.linear else VllmOptions.gdn_prefill_backend)
    return {"window_in_flight": rules.in_flight, "prefill_checkpoints": checkpoints,
            "align_on_given_block": rules.align_on_given_block, "gdn_prefill_backend": kernel}


def _checkpoints(opts: VllmOptions) -> bool:
    """Does a GDN layer take a prefill checkpoint block (and its grid) in this configuration?"""
    return opts.prefill_checkpoints and opts.mamba_cache_mode == "align" and opts.gdn_prefill_backend == "flashinfer"


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
    align = max(FLASH_ATTN_BLOCK_MULTIPLE, opts.block_size) if opts.align_on_given_block else FLASH_ATTN_BLOCK_MULTIPLE
    if _checkpoints(opts):
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
            ckpt = int(_checkpoints(opts))
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
