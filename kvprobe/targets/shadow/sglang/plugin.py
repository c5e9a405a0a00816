"""kvprobe's SGLang plugin: the real SGLang serving stack with the model taken out.

SGLang 0.5.23 loads every entry point of the group `sglang.srt.plugins` early in each of its
processes (`sglang/srt/plugins/__init__.py::load_plugins`, called from `run_scheduler_process`
scheduler.py L6323, the detokenizer L552, the launcher engine.py L286). kvprobe writes such an entry
point into its shadow environment (`kvprobe/targets/shadow/sglang/env.py`); it points at `register` below,
which does nothing unless `KVPROBE_SHADOW=1` — a real GPU install that happens to have kvprobe is
never touched.

Five REPLACE hooks take the model out, and a sixth the sampler's logit shaping that only a model's
logits would use; everything else — ServerArgs, the tokenizer manager, the scheduler with
PrefillAdder / retract_decode / new_token_ratio, the allocator and radix cache, the KV pool with its
real buffers, the detokenizer, HTTP and metrics — stays SGLang's own code:

| target | stands in for |
|---|---|
| ModelRunner.load_model | weights: an empty module with the metadata the runner reads |
| KVCacheConfigurator._profile_available_bytes | GPU profiling: a declared GPU's budget, or one no pool reaches so `--max-total-tokens` sizes it |
| ModelRunner.init_attention_backends | kernels: no backend |
| ModelRunner.init_cuda_graphs | graph capture: nothing captured |
| TpModelWorker.forward_batch_generation | the forward: one pseudo token per request after the modelled step time |
| SamplingBatchInfo.update_penalties | the penalizers' (batch x vocabulary) logit bias: no logits, no bias |

This module is imported in every SGLang process: standard library only; the hooks themselves
(`sglang_hooks.py`, torch and SGLang) are imported only when the plugin acts.
"""

from __future__ import annotations

import os
import pkgutil

# Environment variables kvprobe's launch sets for SGLang's processes (kvprobe/targets/shadow/sglang/target.py).
ACTIVE_ENV = "KVPROBE_SHADOW"  # "1": act (kvprobe.targets.shadow.launch.ENV_ACTIVE)
TIME_MODEL_ENV = "KVPROBE_SHADOW_TIME_MODEL"  # TimeModel.encode() (kvprobe.targets.shadow.launch.ENV_TIME_MODEL)
GPU_FREE_ENV = "KVPROBE_SHADOW_GPU_FREE_BYTES"  # a declared GPU's free memory before the weights, bytes
WEIGHT_BYTES_ENV = "KVPROBE_SHADOW_WEIGHT_BYTES"  # the model's weights on the rank (the ledger's), bytes
LOG_PREFIX = "kvprobe shadow:"  # every line the plugin writes to SGLang's log starts with it

# Hook targets, SGLang 0.5.23 (file:line of each definition).
TARGETS = {
    "load_model": "sglang.srt.model_executor.model_runner.ModelRunner.load_model",  # model_runner.py L1270
    "profile_available_bytes": "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
                               "_profile_available_bytes",  # kv_cache_configurator.py L2990
    "init_attention_backends": "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends",  # L1105
    "init_cuda_graphs": "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs",  # L1170
    "forward_batch_generation": "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",  # tp_worker.py L622
    "update_penalties": "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.update_penalties",  # L410
}


def active() -> bool:
    return os.environ.get(ACTIVE_ENV) == "1"


def replacements() -> list[tuple[str, object]]:
    """(dotted target, replacement function) for the six hooks."""
    from kvprobe.targets.shadow.sglang import hooks as sglang_hooks

    return [(target, getattr(sglang_hooks, name)) for name, target in TARGETS.items()]


def register() -> None:
    """Entry point (`sglang.srt.plugins`): register the replacements when kvprobe asked for them.
    SGLang applies them right after every plugin's register ran (`HookRegistry.apply_hooks`)."""
    if not active():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, fn in replacements():
        HookRegistry.register(target, fn, HookType.REPLACE)


def applied(target: str, fn) -> bool:
    """Whether `target` now calls `fn`: a REPLACE wrapper (hook_registry.py `_wrap_fn`) holds the hook
    in its closure."""
    owner, _, attr = target.rpartition(".")
    current = getattr(pkgutil.resolve_name(owner), attr, None)
    return any(cell.cell_contents is fn for cell in (getattr(current, "__closure__", None) or ()))
