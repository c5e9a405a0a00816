"""Where the vLLM releases kvprobe's shadow worker runs in differ in the interfaces it implements or
builds: the one place that branches on the installed vLLM's version (the worker and `kvspec.py` ask
here). Runs inside the engine environment (imports vllm).

Releases with a shadow recipe: 0.33.0 (the worker is written for it), and 0.18.1 and 0.19.1, either
side of 0.19.0's whole-prompt admission. Each difference below was read in the 0.18.1 and 0.33.0 wheels
(`pip download vllm==V --no-deps`); 0.19.1's files are 0.18.1's for every one of them (v1/worker/
worker_base.py differs only by `load_model`'s keyword `load_dummy_weights`, L125, which the worker already
takes; v1/kv_cache_interface.py, v1/core/sched/output.py and platforms/__init__.py are the same files;
v1/core/kv_cache_utils.py keeps the check-then-override order, `_check_enough_kv_cache_memory` L1579
then `may_override_num_blocks` L823-836; no kv_cache_planning module, no layout RPC in v1/engine/core.py).
So the old interfaces run through 0.19.1, `OLD_INTERFACES_THROUGH`; 0.26.0-0.32.0 are at the end.

Each difference, 0.33.0 first, then 0.18.1 (files under vllm/):

- `compile_or_warm_up_model` returns `CompilationTimes(language_model, encoder)` (v1/worker/worker_base.py
  L39-41, L121) / a float, the compilation seconds (v1/worker/worker_base.py L89; v1/executor/abstract.py
  L118-126 takes the max). -> `compile_times`
- `get_supported_kv_cache_layouts` is asked by EngineCore (v1/engine/core.py L288; the default preference
  is v1/attention/backends/utils.py `_DEFAULT_LAYOUT_PREFERENCE` L229-236) / never asked (no such RPC),
  and `_DEFAULT_LAYOUT_PREFERENCE` does not exist. -> `default_kv_cache_layouts`
- The attention specs carry `kv_quant_mode` (`get_kv_quant_mode`), MLA's `max_tp_shards`,
  `state_content_bytes`, `topk_buffer_width`, `cache_role` (`SparseCacheRole`) / only `block_size,
  num_kv_heads, head_size, dtype, page_size_padded, head_size_v, sliding_window, attention_chunk_size`
  (v1/kv_cache_interface.py L65-107), MLA adds `cache_dtype_str` alone (L191-193), `MambaSpec` has no
  prefill checkpoints (L274-280). -> `quant_fields`, `refusal`
- `--num-gpu-blocks-override` with no profiled bytes: the planner puts override x bytes per block in
  their place before it checks them (v1/core/kv_cache_planning.py L1510-1531) / it checks the profiled
  bytes first (v1/core/kv_cache_utils.py L1571-1578; `_check_enough_kv_cache_memory` L616-627 refuses 0
  bytes: "No available memory for the cache blocks") and applies the override after
  (`may_override_num_blocks` L820-833). -> `override_pool_bytes`
- `NewRequestData.prompt_len` is a property (v1/core/sched/output.py L85-91) / absent; the same two
  fields, `prompt_token_ids` and `prompt_embeds`, are there (v1/core/sched/output.py L31-43). -> `prompt_len`
  (no branch: 0.33's computation works on both)
- The CPU platform is chosen by `VLLM_TARGET_DEVICE=cpu` (platforms/__init__.py L173-181) / only for a CPU
  build of vLLM or on macOS (platforms/__init__.py L163-185). Not a worker interface: the 0.18.1 recipe
  installs `cpu_platform_plugin.py` (`env.py`), so the branch is the recipe.

So on 0.18.1 the worker describes full-attention models only (MLA, DSA indexers and hybrid layers are
refused at start-up, naming the release): those specs are written with 0.33's fields.

0.26.0-0.32.0 (read in their wheels for kvprobe issue 23) have 0.33.0's interfaces for every branch
above but two, so each of those has its own threshold beside `OLD_INTERFACES_THROUGH`:

- `compile_or_warm_up_model` -> `CompilationTimes` (0.26.0 v1/worker/worker_base.py L34, L102; 0.32.0
  L39, L116); `get_kv_quant_mode` (0.26.0 v1/kv_cache_interface.py L62; 0.32.0 L91); the override
  applied before the check (0.26.0 v1/core/kv_cache_utils.py L2107-2120 put override x bytes per block in
  the profiled bytes' place, the check follows at L2132; 0.30.0 L2703-2737, 0.32.0 the same); the
  CPU platform plugin is the recipe's (`env.py` TARGET_DEVICE_RULE_FROM, 0.28.0), not a branch here.
- The KV layout RPC, `LAYOUT_RPC_FROM`: 0.26.0, 0.27.1 and 0.28.0 have neither EngineCore's
  `get_supported_kv_cache_layouts` call nor `_DEFAULT_LAYOUT_PREFERENCE`; 0.29.0 has both (v1/engine/
  core.py L291, v1/attention/backends/utils.py L176), as 0.30.0-0.32.0 do (0.32.0: L298, L195).
- The MLA and hybrid spec fields kvspec writes, `SPEC_FIELDS_FROM`: `MLAAttentionSpec.topk_buffer_width`
  is in 0.33.0 alone (v1/kv_cache_interface.py L732; absent from 0.26.0-0.32.0), `max_tp_shards` from
  0.31.0 (L489), `SparseCacheRole` from 0.30.0 (L150), `MambaSpec.prefill_checkpoint_alignment` from
  0.32.0 (L1043), and v1/core/kv_cache_planning.py (the planner `kvplan.py` runs) exists in 0.33.0 only.
  So every release before 0.33.0 describes full-attention models only.
"""

from __future__ import annotations

from vllm import __version__ as VLLM_VERSION

from kvprobe.releases import version_tuple

# The newest release read with 0.18.1's worker and spec interfaces (see the table above).
OLD_INTERFACES_THROUGH = (0, 19, 1)
# True on 0.18.1's and 0.19.1's worker and spec interfaces; False on 0.33.0's.
OLD_INTERFACES = version_tuple(VLLM_VERSION) <= OLD_INTERFACES_THROUGH
# The first release whose EngineCore asks the worker for its KV cache layouts (see above).
LAYOUT_RPC_FROM = (0, 29)
# The first release with every field of the MLA, DSA-indexer and hybrid specs kvspec writes, and with
# v1/core/kv_cache_planning.py; before it only full-attention models are described (see above).
SPEC_FIELDS_FROM = (0, 33)
# True where the worker describes MLA and hybrid models, and kvplan.py runs vLLM's planner.
FULL_SPECS = version_tuple(VLLM_VERSION) >= SPEC_FIELDS_FROM


def compile_times():
    """What `compile_or_warm_up_model` returns when nothing was compiled."""
    if OLD_INTERFACES:
        return 0.0
    from vllm.v1.worker.worker_base import CompilationTimes

    return CompilationTimes(language_model=0.0, encoder=0.0)


def default_kv_cache_layouts() -> list[str]:
    """The layouts a worker with no attention backend supports: vLLM's default preference (0.33),
    nothing on a release that never asks (before 0.29.0, `LAYOUT_RPC_FROM`)."""
    if version_tuple(VLLM_VERSION) < LAYOUT_RPC_FROM:
        return []
    from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE

    return [layout.name for layout in _DEFAULT_LAYOUT_PREFERENCE]


def quant_fields(cache_dtype: str) -> dict:
    """The attention spec's quantization field for this cache dtype (0.33: `kv_quant_mode`); none on 0.18.1."""
    if OLD_INTERFACES:
        return {}
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    return {"kv_quant_mode": get_kv_quant_mode(cache_dtype)}


def override_pool_bytes(num_blocks: int, specs: dict) -> int:
    """The bytes a worker sized by `--num-gpu-blocks-override` alone reports: none on 0.33 (its planner
    puts override x bytes per block in their place); on 0.18.1 that same product, the pool the override
    asks for, so that the planner's check sees what 0.33's would (num_blocks = bytes // page // layers,
    kv_cache_utils.py L836-849, gives back the override)."""
    if not OLD_INTERFACES:
        return 0
    return num_blocks * sum(spec.page_size_bytes for spec in specs.values())


def refusal(kind: str) -> str | None:
    """Before 0.33.0 (`SPEC_FIELDS_FROM`) only full attention is described: the reason a model of another
    layer kind is refused there (kvspec raises it at start-up), or None."""
    if FULL_SPECS:
        return None
    return (f"kvprobe's shadow worker describes only full-attention (MHA/GQA) models on vLLM {VLLM_VERSION}; this "
            f"model has {kind}, whose KV specs are written with vLLM 0.33.0's fields")


def prompt_len(new_request) -> int:
    """A new request's prompt length, as 0.33's `NewRequestData.prompt_len` computes it (0.18.1 has
    no such property; the same two fields are there)."""
    if new_request.prompt_token_ids is not None:
        return len(new_request.prompt_token_ids)
    if new_request.prompt_embeds is not None:
        return new_request.prompt_embeds.shape[0]
    return 0
