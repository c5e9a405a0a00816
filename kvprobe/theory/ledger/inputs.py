"""What a ledger is asked: one configuration (the engine, the model, the flags that size the pool and
the scheduler, the request shape), as a face writes it ("24GiB", "8k", "auto"), normalized and checked."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvprobe.errors import ConfigError
from kvprobe.releases import ENGINES
from kvprobe.theory.model.mxfp4 import GPU_ARCHS
from kvprobe.theory.vllm.hybrid.kv_cache_spec import CAPABILITY_FORM
from kvprobe.units import parse_bytes, parse_count


@dataclass
class LedgerInputs:
    engine: str
    model: str
    engine_version: str | None = None
    gpu_memory_bytes: int | None = None
    gpu_free_memory_bytes: int | None = None  # free when the engine starts (a shared card); None: the whole card
    gpu_name: str | None = None  # the card by name (--gpu): vLLM's batch defaults set an A100 apart
    gpu_arch: str | None = None  # "sm90" (Hopper, the default) / "sm100": MXFP4 expert padding (mxfp4.py)
    # compute capability "major.minor" of the card (spec/gpus.py; from gpu_arch where only that is given); None: a
    # Hopper, as gpu_arch. vLLM picks a Gated DeltaNet layer's prefill kernel by it (gdn_prefill_backend)
    gpu_capability: str | None = None
    gpu_sms: int | None = None  # the card's SMs where known by name (spec/gpus.py); else its arch's (memory_profile.py)
    gpu_memory_utilization: float | None = None
    mem_fraction_static: float | None = None
    dtype: str | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None  # --quantization: fp8 quantises a 16-bit checkpoint's linear layers online
    block_size: int | None = None
    page_size: int | None = None
    max_model_len: int | None = None  # -1 = vLLM's `auto` (fit the pool)
    context_length: int | None = None
    max_num_seqs: int | None = None
    max_num_active_seqs: int | None = None  # vLLM --max-num-active-seqs (0.31.0 on: theory/vllm/releases.py)
    max_running_requests: int | None = None
    max_num_batched_tokens: int | None = None
    chunked_prefill_size: int | None = None
    tp: int = 1
    pp: int = 1
    dp: int = 1
    enable_expert_parallel: bool = False  # vLLM --enable-expert-parallel: experts whole over TP x DP ranks
    enforce_eager: bool = False  # vLLM --enforce-eager: no CUDA graphs profiled or captured
    num_gpu_blocks_override: int | None = None
    max_total_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    # vLLM 0.34.0 --[no-]enable-extensible-kv-cache; None: the engine resolves it (theory/vllm/releases.py)
    enable_extensible_kv_cache: bool | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    users: int | None = None
    policy: str | None = None
    enable_prefix_caching: bool | None = None
    disable_radix_cache: bool = False
    swa_full_tokens_ratio: float | None = None  # SGLang --swa-full-tokens-ratio (hybrid sliding-window models)
    mamba_radix_cache_strategy: str | None = None  # SGLang (Qwen3-Next): None = its default, extra_buffer
    disable_overlap_schedule: bool = False  # SGLang --disable-overlap-schedule
    disable_piecewise_cuda_graph: bool = False  # SGLang 0.5.10-0.5.19 --disable-piecewise-cuda-graph
    disable_cuda_graph: bool = False  # SGLang --disable-cuda-graph (its reserves: from 0.5.14)
    # SGLang's hybrid-pool flags (theory/sglang/pools.py SglangOptions; None: SGLang's default)
    disable_hybrid_swa_memory: bool = False
    max_mamba_cache_size: int | None = None
    mamba_full_memory_ratio: float | None = None
    mamba_ssm_dtype: str | None = None
    reserve_full_isl: bool = True
    gdn_prefill_backend: str | None = None  # vLLM --gdn-prefill-backend; None: the platform's choice
    watermark: float = 0.0  # vLLM --watermark (0.24.0 on; theory/vllm/releases.py WATERMARK_FROM)
    async_scheduling: bool | None = None  # vLLM; None: not given (the faces pass the engine's default)
    shared_prefix_tokens: int = 0  # K tokens shared by every prompt (a system prompt)
    estimates: dict[str, int] = field(default_factory=dict)
    base_dir: str | None = None


def _positive(name: str, value: int | None, *, allow_none=True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"expected a positive integer, got {value!r}", key=name)


def validate(inp: LedgerInputs) -> None:
    if inp.engine not in ENGINES:
        raise ConfigError(f"expected one of {', '.join(ENGINES)}, got {inp.engine!r}", key="engine")
    for name in ("tp", "pp", "dp"):
        _positive(name, getattr(inp, name), allow_none=False)
    if inp.gpu_arch is not None and inp.gpu_arch not in GPU_ARCHS:
        raise ConfigError(f"expected one of {', '.join(GPU_ARCHS)}, got {inp.gpu_arch!r}", key="gpu_arch")
    if inp.gpu_capability is not None and not CAPABILITY_FORM.fullmatch(str(inp.gpu_capability)):
        raise ConfigError(f"expected a compute capability such as 8.0 or 9.0, got {inp.gpu_capability!r}",
                          key="gpu_capability")
    for name in ("block_size", "page_size", "context_length", "max_num_seqs", "max_num_active_seqs",
                 "max_running_requests",
                 "max_num_batched_tokens", "num_gpu_blocks_override", "max_total_tokens",
                 "kv_cache_memory_bytes", "gpu_memory_bytes", "gpu_free_memory_bytes", "prompt_tokens",
                 "output_tokens", "users"):
        _positive(name, getattr(inp, name))
    if inp.max_model_len is not None and inp.max_model_len != -1:
        _positive("max_model_len", inp.max_model_len)
    if (inp.prompt_tokens is None) != (inp.output_tokens is None):
        raise ConfigError("give both prompt_tokens and output_tokens, or neither", key="prompt_tokens")


_BYTE_FIELDS = ("gpu_memory_bytes", "gpu_free_memory_bytes", "kv_cache_memory_bytes")
_COUNT_FIELDS = ("block_size", "page_size", "max_model_len", "context_length", "max_num_seqs",
                 "max_num_active_seqs", "max_running_requests", "max_num_batched_tokens", "chunked_prefill_size",
                 "num_gpu_blocks_override", "max_total_tokens", "prompt_tokens", "output_tokens", "users",
                 "shared_prefix_tokens")


def normalized(inp: LedgerInputs) -> LedgerInputs:
    """Accept sizes and counts as written in flags ("24GiB", "8k", "auto" for max_model_len)."""
    changes = {}
    for name in _BYTE_FIELDS:
        value = getattr(inp, name)
        if isinstance(value, str):
            changes[name] = parse_bytes(value, key=name)
    for name in _COUNT_FIELDS:
        value = getattr(inp, name)
        if isinstance(value, str):
            changes[name] = -1 if name == "max_model_len" and value.strip() in ("auto", "-1") \
                else parse_count(value, key=name)
    for name in ("gpu_memory_utilization", "mem_fraction_static"):
        value = getattr(inp, name)
        if isinstance(value, str):
            try:
                changes[name] = float(value)
            except ValueError as err:
                raise ConfigError(f"expected a fraction such as 0.9, got {value!r}", key=name) from err
    return dataclasses.replace(inp, **changes) if changes else inp
