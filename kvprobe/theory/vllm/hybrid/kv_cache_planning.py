"""vLLM 0.33.0's planner for hybrid models: how the layer specs (`kv_cache_spec`) are grouped into
one block pool, how many blocks the pool holds, and the capacity line and "maximum concurrency"
it logs (vllm/v1/core/kv_cache_planning.py and kv_cache_utils.py, file and line in the released
wheel):

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

from dataclasses import dataclass, field

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import ModelGeometry
from kvprobe.theory.model.sizes import cdiv, format_gib
from kvprobe.theory.vllm.hybrid.kv_cache_spec import (
    CHUNKED_SPEC,
    FULL_SPEC,
    MAMBA_SPEC,
    SLIDING_SPEC,
    VllmLayerSpec,
    VllmOptions,
    hybrid_kv_cache_manager,
    vllm_layer_specs,
)


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


NO_KV_MEMORY = ("No available memory for the cache blocks. Try increasing "
                "`gpu_memory_utilization` when initializing the engine.")


def not_enough_kv_memory(max_model_len: int, needed_bytes: int, available_bytes: int,
                         estimated: int | None) -> str:
    """vLLM's start-up refusal when one max_model_len request does not fit the pool
    (`_check_enough_kv_cache_memory`, kv_cache_planning.py L50-87); `estimated` None leaves out
    the estimated maximum model length."""
    est_msg = (f"Based on the available memory, the estimated maximum model length is {estimated}. "
               if estimated is not None else "")
    return (f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"({format_gib(needed_bytes)} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({format_gib(available_bytes)} GiB). {est_msg}Try increasing `gpu_memory_utilization` (which "
            f"also controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing "
            f"the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more "
            f"details.")


def _check_fits(specs, groups, bpb: int, check: int, max_model_len: int, inflight: int) -> None:
    """`_check_enough_kv_cache_memory` (L50-87) with the group-aware need (L1253-1285)."""
    if check <= 0:
        raise ConfigError(NO_KV_MEMORY)
    needed = _needed_bytes(groups, bpb)
    if needed <= check:
        return
    est = _estimate_max_model_len(specs, check, max_model_len, inflight)
    raise ConfigError(not_enough_kv_memory(max_model_len, needed, check, est if est > 0 else None))
