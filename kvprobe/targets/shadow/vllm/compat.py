"""Where the vLLM releases kvprobe's shadow worker runs in differ in the interfaces it implements or
builds: the one place that branches on the installed vLLM's version (the worker, `kvspec.py` and
`kvplan.py` ask here). Runs inside the engine environment (imports vllm).

Releases with a shadow recipe: 0.33.0 (the worker is written for it), 0.18.1 and 0.19.1 (either side of
0.19.0's whole-prompt admission), and 0.20.2, 0.21.0, 0.22.1, 0.23.0, 0.24.0, 0.25.1 (the latest patch of
each minor release of the year before), and 0.26.0, 0.27.1, 0.28.0, 0.29.0, 0.30.0, 0.31.0,
0.32.0, and 0.34.0 (the release after it: the last four entries below). Each interface has its own threshold,
the newest release read with the old form: `through(THRESHOLD)` is True on it and before.
The files were read in each release's wheel (`pip download vllm==V --no-deps`); 0.19.1's files are
0.18.1's for every interface below (v1/worker/worker_base.py differs only by `load_model`'s keyword
`load_dummy_weights`, L125, which the worker already takes).

Each interface, new form first, then old (files under vllm/):

- `compile_or_warm_up_model` returns `CompilationTimes(language_model, encoder)` / a float, the compilation
  seconds. Old through 0.19.1 (v1/worker/worker_base.py L89 in 0.18.1 and 0.19.1; v1/executor/abstract.py
  L118-126 takes the max); new from 0.20.2 (worker_base.py L33-35 the NamedTuple, L94 the signature;
  executor/abstract.py L124-125 collects a list of them; 0.33.0: L39-41, L121). -> `compile_times`
- `get_supported_kv_cache_layouts` is asked by EngineCore, with `_DEFAULT_LAYOUT_PREFERENCE` as the default /
  never asked (no such RPC) and the preference does not exist. Old through 0.28.0 (neither name anywhere
  under vllm/ in 0.20.2-0.25.1; not in 0.26.0-0.28.0's v1/engine/core.py nor v1/attention/backends/utils.py);
  new from 0.29.0 (core.py L291, utils.py L176; 0.32.0: L298, L195; 0.33.0: L288, L229-236).
  -> `default_kv_cache_layouts`
- Attention specs carry `kv_quant_mode` (`get_kv_quant_mode`) / they do not (v1/kv_cache_interface.py
  L65-107 in 0.18.1 and 0.19.1). Old through 0.19.1; new from 0.20.2 (kv_cache_interface.py L58
  `get_kv_quant_mode`, L134 `kv_quant_mode: KVQuantMode = KVQuantMode.NONE`; 0.25.1: L62, L168). -> `quant_fields`
- The MLA layer's spec (`MLAAttention.get_kv_cache_spec`, model_executor/layers/attention/mla_attention.py),
  built with the fields that release's layer passes, each meaning there what it means to that release's
  planner (DeepSeek-V3's latent cache, 576 values a token; one threshold per field):
  `kv_quant_mode`: not passed through 0.25.1 (L1004-1010 in 0.24.0 and 0.25.1, L841-851 in 0.18.1: the
  field keeps NONE although AttentionSpec has it from 0.20.2), passed from 0.26.0 (L1085). ->
  `MLA_NO_QUANT_MODE_THROUGH`.
  The ds_mla page: `cache_dtype_str == "fp8_ds_mla"` makes `real_page_size_bytes` 656 a token through
  0.27.1 (kv_cache_interface.py L197-200 in 0.18.1, L409-416 in 0.27.1); from 0.28.0 the layer passes
  `state_content_bytes` (mla_attention.py L1159, kv_cache_interface.py L230; 0.30.0 L1361-1363 adds
  nvfp4_ds_mla's 352, a cache dtype 0.28.0 and 0.29.0 do not have). -> `MLA_NO_STATE_BYTES_THROUGH`.
  `max_tp_shards=1`: absent through 0.30.0; from 0.31.0 (kv_cache_interface.py L489, mla_attention.py
  L1353). -> `NO_MAX_TP_SHARDS_THROUGH`. All three: `mla_fields`.
- DSA indexers: the indexer cache is an MLAAttentionSpec with `cache_role=SparseCacheRole.INDEXER` and the
  MLA layers that own one say `is_index_group_leader` from 0.30.0 (models/deepseek_v2.py L657-664,
  mla_attention.py L1372, kv_cache_interface.py L150, L652-653; `max_tp_shards=1` on it from 0.31.0, L661);
  through 0.29.0 the indexer cache is a plain MLAAttentionSpec (deepseek_v2.py L599-605 in 0.18.1, L653-659
  in 0.29.0) that kvprobe does not write: refused. `topk_buffer_width` (0.33.0 alone, L732, L1397) is read
  by the hisparse layout only (v1/hisparse/layout.py L139), not by the planner. Which layers own an
  indexer (`index_topk_freq`, `index_topk_pattern`) is the same code in 0.30.0 (L1141-1152) as in 0.33.0.
  -> `NO_INDEXER_ROLE_THROUGH`, `dsa_leader_fields`, `indexer_fields`, `refusal`
- Mamba / linear-attention layers (MambaSpec, v1/kv_cache_interface.py; the Gated DeltaNet layer's spec is the
  base Mamba layer's through 0.32.0, model_executor/layers/mamba/abstract.py L43-58 in 0.18.1, L44-60 in
  0.21.0-0.25.1, L63-79 in 0.27.1 and 0.28.0, L67-86 in 0.29.0, L65 in 0.31.0 and 0.32.0), four forms:
  `shapes, dtypes, page_size_padded, mamba_type, mamba_cache_mode, num_speculative_blocks` with `mamba_type` a
  str ("gdn_attention" for Gated DeltaNet, the layer's own property: models/qwen3_next.py L375-376 in 0.18.1,
  layers/mamba/gdn_linear_attn.py L217-218 in 0.20.2; the attention selector looks it up in
  MAMBA_TYPE_TO_BACKEND_MAP, v1/attention/backends/registry.py L196-202) through 0.20.2 (L278 in 0.18.1 and
  0.19.1, L525 in 0.20.2); the same fields with the MambaAttentionBackendEnum from 0.21.0 (L547; the map is gone
  and the selector asserts the enum, v1/attention/selector.py L150) through 0.28.0 (L567 in 0.22.1, L633 in
  0.24.0, L669-675 in 0.25.1, L690-696 in 0.26.0, L710-716 in 0.27.1, L668-674 in 0.28.0);
  + `num_prefill_checkpoint_blocks` from 0.29.0 (L858) and `prefill_checkpoint_alignment` from 0.30.0 (L1001;
  0.31.0 L1050, 0.32.0 L1043; 0.33.0 L1101-1102). The worker fills them with what the release's GDN layer
  sets: 0 and None through 0.32.0, whose layer leaves the defaults; one block on the 64-token grid from 0.33.0
  (a theory rule: `theory/vllm/releases.py` MAMBA_CHECKPOINTS_FROM). The
  mode the specs carry must be the one the engine resolved (model_executor/models/config.py MambaModelConfig:
  "align" with prefix caching for Qwen3-Next on every release read, its class not SupportsMambaPrefixCaching,
  qwen3_next.py L767-775 in 0.27.1, L798-806 in 0.29.0, L813-821 in 0.32.0), else `kvspec` refuses.
  -> `MAMBA_STR_TYPE_THROUGH`, `MAMBA_NO_CHECKPOINTS_THROUGH`, `MAMBA_NO_ALIGNMENT_THROUGH`, `mamba_type`,
  `mamba_fields`
- Window layers (sliding-window, chunked-local): SlidingWindowSpec takes no `head_size_v` through 0.19.1 (its
  fields are AttentionSpec's and `sliding_window`, kv_cache_interface.py L248-249 in 0.18.1 and 0.19.1; only
  FullAttentionSpec has one, L101), its own from 0.20.2 (L404-406), AttentionSpec's from 0.28.0 (L218-222);
  ChunkedLocalAttentionSpec never takes one (L229-230 in 0.18.1). -> `attention_fields`. Nothing else differs
  in what the layers pass, so window models are described on every release read here.
- `--num-gpu-blocks-override` with no profiled bytes: override x bytes per block takes the profiled
  bytes' place before they are checked / the profiled bytes are checked first (v1/core/kv_cache_utils.py
  L1571-1578 in 0.18.1; `_check_enough_kv_cache_memory` L616-627 refuses 0 bytes: "No available memory
  for the cache blocks"; 0.19.1: L1579) and the override applied after (`may_override_num_blocks`
  L820-833; 0.19.1 L823-836). Old through 0.19.1; new from 0.20.2 (kv_cache_utils.py L1982-2002 puts
  `override * bytes_per_block` in `available_memory`, the check follows at L2009-2017; 0.25.1: L2070-2090,
  L2097; 0.26.0 L2107-2132, 0.30.0 L2703-2737; 0.33.0 moved it to v1/core/kv_cache_planning.py L1510-1531).
  -> `override_pool_bytes`
- vLLM's KV planner as a module, v1/core/kv_cache_planning.py (`get_global_kv_cache_groups`,
  `get_kv_cache_configs`), which `kvplan.py` runs / the planner is in kv_cache_utils.py. Old through 0.32.0
  (no kv_cache_planning.py in 0.20.2-0.32.0: `get_kv_cache_configs` is kv_cache_utils.py L1920 in 0.20.2,
  L2005 in 0.25.1, L2617 in 0.30.0, L2684 in 0.31.0); new in 0.33.0. -> `PLANNER_MODULE` (kvplan.py)
- `NewRequestData.prompt_len` is a property (v1/core/sched/output.py L85-91, 0.33.0; from 0.29.0, L80) /
  absent through 0.28.0;
  the same two fields, `prompt_token_ids` and `prompt_embeds`, are there (output.py L31-43 in 0.18.1, L33,
  L40 in 0.20.2-0.25.1). -> `prompt_len` (no branch: 0.33's computation works on all)
- The CPU platform is chosen by `VLLM_TARGET_DEVICE=cpu` (platforms/__init__.py L173-181, 0.33.0) / only
  for a CPU build of vLLM or on macOS (platforms/__init__.py L163-185 in 0.18.1-0.23.0, L162-184 in 0.24.0
  and 0.25.1, L162 in 0.26.0-0.27.1; by `VLLM_TARGET_DEVICE=cpu` from 0.28.0, L162-168). Not a worker
  interface: those recipes install `cpu_platform_plugin.py` (`env.py` TARGET_DEVICE_RULE_FROM).
- `ModelRunnerOutput(req_ids, sampled_token_ids, ...)` / also `req_id_to_index` (v1/outputs.py L271 in
  0.33.0, a required field; `EMPTY_MODEL_RUNNER_OUTPUT` L414 passes `{}`). Old through 0.33.0; new in 0.34.0
  (outputs.py L267-305 have no such field, L408 `ModelRunnerOutput(req_ids=[])`; the scheduler indexes by
  `req_ids`, v1/core/sched/scheduler.py L2356-2359). -> `runner_output`
- `cache_config.gpu_memory_utilization` is the fraction / may be None: 0.34.0 defaults it to None
  (config/cache.py L216) and sizes by `resolved_gpu_memory_utilization` (L494-501: the given value, else
  1.0 with the extensible KV cache, else 0.92; v1/worker/utils.py L742-743). On the CPU platform the
  extensible KV cache is off (config/vllm.py L3201: not CUDA-alike), so that is 0.92 unless given. No such
  property through 0.33.0 (the field defaults to 0.92, config/cache.py L215). -> `gpu_memory_utilization`
  (no threshold: the property where it exists)
- A preempted request comes back to the worker as a `NewRequestData` whose `prefill_token_ids` are the prompt
  and the tokens generated before preemption (v1/core/sched/scheduler.py L1619-1626, L1714-1723 in 0.34.0;
  v1/request.py L320-330; a required field, v1/core/sched/output.py L51) / in
  `CachedRequestData.resumed_req_ids` with `all_token_ids` (0.33.0 scheduler.py L1557-1562, L1970-1976)
  and there, as on 0.18.1-0.32.0, its `NewRequestData.prefill_token_ids` is None or the prompt alone.
  0.33.0 sends resumed requests as new ones only to its V2 model runner (L1642-1652, `req._all_token_ids`),
  which the CPU platform does not pick (no Triton). -> `output_len` (no branch: generated = prefill - prompt,
  0 where prefill_token_ids is None or the prompt)
- The CPU platform refuses an x86 machine without Triton (platforms/cpu.py L241-243 in 0.34.0, in
  `check_and_update_config`) / only warns (0.33.0 L241-244). Not a worker interface: the 0.34.0 pins install
  Triton and the launcher sets CUDA_VISIBLE_DEVICES="" (`target.py` TRITON_REQUIRED_FROM), so that
  vllm/triton_utils/importing.py L53-70 accepts a Triton with no active driver.

So on 0.18.1-0.32.0 the worker describes full-attention, window (sliding / chunked-local) and MLA models, DSA
indexers from 0.30.0 and Mamba / Gated DeltaNet layers; DSA through 0.29.0 is refused at start-up there, naming
the release and the kind.
"""

from __future__ import annotations

from vllm import __version__ as VLLM_VERSION

from kvprobe.releases import version_tuple

# One threshold per interface: the newest release read with the old form (the table above).
COMPILE_TIMES_FLOAT_THROUGH = (0, 19, 1)  # 0.19.1 worker_base.py L89 float / 0.20.2 L33-35, L94 CompilationTimes
NO_KV_QUANT_MODE_THROUGH = (0, 19, 1)  # 0.19.1 kv_cache_interface.py L65-107 / 0.20.2 L58, L134
OVERRIDE_AFTER_CHECK_THROUGH = (0, 19, 1)  # 0.19.1 kv_cache_utils.py L1579, L823-836 / 0.20.2 L1982-2002, L2009
NO_LAYOUT_RPC_THROUGH = (0, 28, 0)  # 0.28.0 no such RPC / 0.29.0 v1/engine/core.py L291
OLD_SPEC_FIELDS_THROUGH = (0, 32, 0)  # 0.32.0 no topk_buffer_width / 0.33.0 kv_cache_interface.py L732
MLA_NO_QUANT_MODE_THROUGH = (0, 25, 1)  # 0.25.1 mla_attention.py L1004-1010 / 0.26.0 L1085 kv_quant_mode
MLA_NO_STATE_BYTES_THROUGH = (0, 27, 1)  # 0.27.1 cache_dtype_str (L409-416) / 0.28.0 mla_attention.py L1159
NO_INDEXER_ROLE_THROUGH = (0, 29, 0)  # 0.29.0 deepseek_v2.py L653-659 plain spec / 0.30.0 L657-664 INDEXER
NO_MAX_TP_SHARDS_THROUGH = (0, 30, 0)  # 0.30.0 no field / 0.31.0 kv_cache_interface.py L489, mla_attention L1353
NO_PLANNER_MODULE_THROUGH = (0, 32, 0)  # 0.32.0 kv_cache_utils.py / 0.33.0 v1/core/kv_cache_planning.py
SLIDING_NO_HEAD_SIZE_V_THROUGH = (0, 19, 1)  # 0.19.1 kv_cache_interface.py L248-249 / 0.20.2 L404-406
REQ_ID_TO_INDEX_THROUGH = (0, 33, 0)  # 0.33.0 v1/outputs.py L271 req_id_to_index / 0.34.0 L267-305 none
MAMBA_STR_TYPE_THROUGH = (0, 20, 2)  # 0.20.2 kv_cache_interface.py L525 `mamba_type: str` / 0.21.0 L547 the enum
MAMBA_NO_CHECKPOINTS_THROUGH = (0, 28, 0)  # 0.28.0 kv_cache_interface.py L668-674 / 0.29.0 L858 checkpoint blocks
MAMBA_NO_ALIGNMENT_THROUGH = (0, 29, 0)  # 0.29.0 L851-863 / 0.30.0 L1001 prefill_checkpoint_alignment


def through(threshold: tuple[int, ...], version: str = VLLM_VERSION) -> bool:
    """True when `version` (the installed vLLM's by default) has the old form of the interface whose
    threshold this is."""
    return version_tuple(version) <= threshold


# The installed release's forms.
COMPILE_TIMES_FLOAT = through(COMPILE_TIMES_FLOAT_THROUGH)
NO_KV_QUANT_MODE = through(NO_KV_QUANT_MODE_THROUGH)
OVERRIDE_AFTER_CHECK = through(OVERRIDE_AFTER_CHECK_THROUGH)
NO_LAYOUT_RPC = through(NO_LAYOUT_RPC_THROUGH)
OLD_SPEC_FIELDS = through(OLD_SPEC_FIELDS_THROUGH)
PLANNER_MODULE = not through(NO_PLANNER_MODULE_THROUGH)
MLA_NO_QUANT_MODE = through(MLA_NO_QUANT_MODE_THROUGH)
MLA_NO_STATE_BYTES = through(MLA_NO_STATE_BYTES_THROUGH)
NO_MAX_TP_SHARDS = through(NO_MAX_TP_SHARDS_THROUGH)
NO_INDEXER_ROLE = through(NO_INDEXER_ROLE_THROUGH)
SLIDING_NO_HEAD_SIZE_V = through(SLIDING_NO_HEAD_SIZE_V_THROUGH)
REQ_ID_TO_INDEX = through(REQ_ID_TO_INDEX_THROUGH)
MAMBA_STR_TYPE = through(MAMBA_STR_TYPE_THROUGH)
MAMBA_NO_CHECKPOINTS = through(MAMBA_NO_CHECKPOINTS_THROUGH)
MAMBA_NO_ALIGNMENT = through(MAMBA_NO_ALIGNMENT_THROUGH)
# the layer kinds kvprobe writes with fields some releases lack: the releases refused, as (newest release
# described before, newest refused) spans, None for the first release read
DSA_KIND, MAMBA_KIND = "a DSA indexer", "Mamba / linear-attention layers"
REFUSED = {DSA_KIND: ((None, NO_INDEXER_ROLE_THROUGH),), MAMBA_KIND: ()}

# ds_mla layouts pack NoPE + RoPE + scales into one opaque per-token blob (0.33.0 mla_attention.py
# L1383-1389; 0.28.0 and 0.29.0 know fp8_ds_mla alone, L1159; through 0.27.1 the spec's own 656, L197-200)
DS_MLA_STATE_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}


def compile_times():
    """What `compile_or_warm_up_model` returns when nothing was compiled."""
    if COMPILE_TIMES_FLOAT:
        return 0.0
    from vllm.v1.worker.worker_base import CompilationTimes

    return CompilationTimes(language_model=0.0, encoder=0.0)


def default_kv_cache_layouts() -> list[str]:
    """The layouts a worker with no attention backend supports: vLLM's default preference (0.33),
    nothing through 0.28.0, which never asks."""
    if NO_LAYOUT_RPC:
        return []
    from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE

    return [layout.name for layout in _DEFAULT_LAYOUT_PREFERENCE]


def quant_fields(cache_dtype: str) -> dict:
    """The attention spec's quantization field for this cache dtype (0.20.2 on: `kv_quant_mode`); none on
    0.18.1 and 0.19.1."""
    if NO_KV_QUANT_MODE:
        return {}
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    return {"kv_quant_mode": get_kv_quant_mode(cache_dtype)}


def mla_fields(cache_dtype: str) -> dict:
    """The MLA layer spec's fields beside block_size, num_kv_heads=1, head_size and dtype, as this release's
    `MLAAttention.get_kv_cache_spec` passes them (the table above: 0.18.1 `cache_dtype_str` alone;
    0.26.0 `kv_quant_mode`; 0.28.0 `state_content_bytes`; 0.31.0 `max_tp_shards`)."""
    fields: dict = {"cache_dtype_str": cache_dtype}
    if not MLA_NO_QUANT_MODE:
        from vllm.v1.kv_cache_interface import get_kv_quant_mode

        fields["kv_quant_mode"] = get_kv_quant_mode(cache_dtype)
    if not MLA_NO_STATE_BYTES:
        fields["state_content_bytes"] = DS_MLA_STATE_BYTES.get(cache_dtype)
    if not NO_MAX_TP_SHARDS:
        fields["max_tp_shards"] = 1
    return fields


def dsa_leader_fields(index_topk: int | None, leader: bool) -> dict:
    """A DSA model's MLA layer: whether it owns an indexer (0.30.0 on, mla_attention.py L1372) and, on 0.33.0,
    the sparse top-k buffer's width (L1397; DeepseekV2Model allocates it [max_num_batched_tokens, index_topk],
    deepseek_v2.py L1439-1449)."""
    fields: dict = {"is_index_group_leader": leader}
    if not OLD_SPEC_FIELDS:
        fields["topk_buffer_width"] = index_topk
    return fields


def indexer_fields() -> dict:
    """The DSA indexer cache's own fields beside block_size, num_kv_heads=1, head_size and dtype (0.30.0
    deepseek_v2.py L657-664; `max_tp_shards` from 0.31.0, L661)."""
    from vllm.v1.kv_cache_interface import SparseCacheRole  # 0.30.0 on (DSA is refused before)

    fields: dict = {"cache_role": SparseCacheRole.INDEXER}
    if not NO_MAX_TP_SHARDS:
        fields["max_tp_shards"] = 1
    return fields


def override_pool_bytes(num_blocks: int, specs: dict) -> int:
    """The bytes a worker sized by `--num-gpu-blocks-override` alone reports: none from 0.20.2 on (the
    planner puts override x bytes per block in their place); on 0.18.1 and 0.19.1 that same product, the
    pool the override asks for, so that the planner's check sees what 0.20's would (num_blocks = bytes //
    page // layers, kv_cache_utils.py L836-849 in 0.18.1, gives back the override)."""
    if not OVERRIDE_AFTER_CHECK:
        return 0
    return num_blocks * sum(spec.page_size_bytes for spec in specs.values())


def attention_fields(spec: str, head_size_v: int) -> dict:
    """The value-head field a window or full attention spec takes on this release (the table above:
    SlidingWindowSpec from 0.20.2, ChunkedLocalAttentionSpec never)."""
    if spec == "ChunkedLocalAttentionSpec" or (spec == "SlidingWindowSpec" and SLIDING_NO_HEAD_SIZE_V):
        return {}
    return {"head_size_v": head_size_v}


# a Mamba layer kind kvprobe writes -> (the str through MAMBA_STR_TYPE_THROUGH, the enum member's name after)
MAMBA_TYPES = {"gdn_attn": ("gdn_attention", "GDN_ATTN")}


def mamba_type(kind: str):
    """A Mamba spec's `mamba_type` as this release's layer gives it: the str through 0.20.2, the
    MambaAttentionBackendEnum member from 0.21.0."""
    old, member = MAMBA_TYPES[kind]
    if MAMBA_STR_TYPE:
        return old
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    return MambaAttentionBackendEnum[member]


def mamba_fields(spec: dict) -> dict:
    """A Mamba spec's prefill-checkpoint fields, as many as the release's MambaSpec has: none through 0.28.0
    (L668-674), the block count from 0.29.0 (L858), its alignment too from 0.30.0 (L1001). Their values are
    the layer spec's (0 and None where the release's GDN layer sets no checkpoint, theory/vllm/releases.py)."""
    fields = {}
    if not MAMBA_NO_CHECKPOINTS:
        fields["num_prefill_checkpoint_blocks"] = spec["num_prefill_checkpoint_blocks"]
    if not MAMBA_NO_ALIGNMENT:
        fields["prefill_checkpoint_alignment"] = spec.get("prefill_checkpoint_alignment")
    return fields


def refused(kind: str, version: str = VLLM_VERSION) -> bool:
    return any((after is None or not through(after, version)) and through(last, version)
               for after, last in REFUSED[kind])


def refusal(kind: str, version: str = VLLM_VERSION) -> str | None:
    """The reason a model with `kind` (DSA_KIND, MAMBA_KIND) is refused on this release (kvspec raises it at
    start-up), or None where kvprobe writes that kind's specs."""
    if not refused(kind, version):
        return None
    kinds = ["full-attention (MHA/GQA)", "window", "MLA"]
    kinds += [] if refused(DSA_KIND, version) else ["DSA-indexer"]
    kinds += [] if refused(MAMBA_KIND, version) else ["Mamba"]
    described = ", ".join(kinds[:-1]) + " and " + kinds[-1]
    return (f"kvprobe's shadow worker describes only {described} models on vLLM {version}; this model has "
            f"{kind}, whose KV specs are written with the fields of other vLLM releases")


def prompt_len(new_request) -> int:
    """A new request's prompt length, as 0.33's `NewRequestData.prompt_len` computes it (0.18.1-0.28.0
    have no such property; the same two fields are there)."""
    if new_request.prompt_token_ids is not None:
        return len(new_request.prompt_token_ids)
    if new_request.prompt_embeds is not None:
        return new_request.prompt_embeds.shape[0]
    return 0


def output_len(new_request) -> int:
    """The tokens a request scheduled as new has already generated: 0 for a new request; for one resumed
    after preemption on 0.34.0, the generated tokens it carries after its prompt (`prefill_token_ids` =
    prompt + generated, v1/core/sched/scheduler.py L1714-1723); 0 where `prefill_token_ids` is None
    (0.33.0's V1 path, earlier releases)."""
    prefill = getattr(new_request, "prefill_token_ids", None)
    if prefill is None:
        return 0
    return max(len(prefill) - prompt_len(new_request), 0)


def runner_output(req_ids: list[str], sampled: list[list[int]]):
    """A step's `ModelRunnerOutput`: with `req_id_to_index` through 0.33.0 (outputs.py L271), without it from
    0.34.0 (the field is gone)."""
    from vllm.v1.outputs import ModelRunnerOutput

    if REQ_ID_TO_INDEX:
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def gpu_memory_utilization(cache_config) -> float:
    """The fraction of device memory the engine sizes by: 0.34.0's `resolved_gpu_memory_utilization`
    (config/cache.py L494-501; 0.92 on the CPU platform, whose extensible KV cache is off, unless given),
    else the field itself (0.92 by default through 0.33.0, config/cache.py L215)."""
    resolved = getattr(cache_config, "resolved_gpu_memory_utilization", None)
    return cache_config.gpu_memory_utilization if resolved is None else resolved
