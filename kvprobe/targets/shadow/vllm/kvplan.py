"""vLLM's own KV planner run on kvprobe's per-layer KV specs — inside a vLLM environment (imports
vllm and torch; run with that environment's python and kvprobe on PYTHONPATH).

The specs become vLLM's `KVCacheSpec` objects through `kvspec.to_vllm_specs`, the very
function the model-less worker's `get_kv_cache_spec` uses for a hybrid model; `plan` runs vLLM
0.33.0's `get_global_kv_cache_groups` + `get_kv_cache_configs` + `get_kv_cache_capacity`
(v1/core/kv_cache_planning.py, kv_cache_utils.py) with no server and no model, so
`kvprobe.theory.vllm.hybrid.kv_cache_spec` can be compared with the engine's arithmetic.

As a program: `python -m kvprobe.targets.shadow.vllm.kvplan < request.json` prints the plan as JSON.
The request holds `specs` (dicts of `theory.vllm.hybrid.kv_cache_spec.VllmLayerSpec` fields), `available_bytes`,
`max_model_len`, `max_num_batched_tokens`, `async_scheduling`, `hybrid_kv_cache_manager`,
`mamba_cache_mode`, and optionally `num_gpu_blocks_override` and `auto_fit`.
"""

from __future__ import annotations

import json
import os
import sys
import types

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no GPU: the planner itself is device-free
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
# 0.34.0's CPU platform refuses x86 without Triton when VllmConfig is built; its environment installs Triton, which
# vLLM keeps with no GPU driver only when this is set and empty (target.py TRITON_REQUIRED_FROM). Harmless before.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

from kvprobe.targets.shadow.vllm import compat  # noqa: E402

if not compat.PLANNER_MODULE:  # through 0.25.1 there is no kv_cache_planning module (the planner is kv_cache_utils')
    sys.exit(f"kvprobe.targets.shadow.vllm.kvplan runs vLLM 0.33.0's planner; this environment holds vLLM "
             f"{compat.VLLM_VERSION}, whose worker describes full-attention models only (compat.py)")

from vllm.config import VllmConfig  # noqa: E402
from vllm.v1.core.kv_cache_planning import (  # noqa: E402
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config,
    get_kv_cache_capacity,
)
from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs  # noqa: E402

from kvprobe.targets.shadow.vllm.kvspec import to_vllm_specs  # noqa: E402


def planner_config(req: dict) -> VllmConfig:
    """A VllmConfig carrying only what the planner reads (no model is loaded or inspected)."""
    vc = VllmConfig()
    mml = req["max_model_len"]
    vc.model_config = types.SimpleNamespace(
        max_model_len=mml, original_max_model_len=-1 if req.get("auto_fit") else mml,
        supports_kv_cache_grouping=False)
    vc.cache_config.kv_cache_layout = "NHD"  # FlashAttention's layer-outer layout (LBNHC)
    vc.cache_config.num_gpu_blocks_override = req.get("num_gpu_blocks_override")
    vc.cache_config.mamba_cache_mode = req.get("mamba_cache_mode", "none")
    sc = vc.scheduler_config
    sc.max_num_batched_tokens = req["max_num_batched_tokens"]
    sc.async_scheduling = req["async_scheduling"]
    sc.disable_hybrid_kv_cache_manager = not req["hybrid_kv_cache_manager"]
    return vc


def _group(g) -> dict:
    spec = g.kv_cache_spec
    layer_specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) \
        else [spec]
    first = layer_specs[0]
    return {"spec": type(first).__name__, "layers": list(g.layer_names),
            "block_size": first.block_size, "page_size_bytes": first.page_size_bytes}


def plan(req: dict) -> dict:
    vc = planner_config(req)
    specs = to_vllm_specs(req["specs"])
    try:
        groups = get_global_kv_cache_groups(vc, [specs])
        configs = get_kv_cache_configs(vc, [specs], [req["available_bytes"]], groups)
    except ValueError as err:
        return {"error": str(err)}
    sched = generate_scheduler_kv_cache_config(configs)
    tokens, concurrency = get_kv_cache_capacity(vc, sched)
    return {"num_blocks": configs[0].num_blocks, "groups": [_group(g) for g in configs[0].kv_cache_groups],
            "kv_tokens": tokens, "max_concurrency": concurrency,
            "max_model_len": vc.model_config.max_model_len,
            "in_flight_tokens": vc.max_in_flight_tokens}


def main() -> int:
    reqs = json.load(sys.stdin)
    json.dump([plan(r) for r in reqs] if isinstance(reqs, list) else plan(reqs), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
