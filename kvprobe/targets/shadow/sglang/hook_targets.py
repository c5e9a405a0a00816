"""What kvprobe's SGLang plugin replaces: the dotted targets of its six hooks, and how to tell that
SGLang applied one. Standard library only: the plugin (in every SGLang process) and the hooks (torch
and SGLang) both read it.
"""

from __future__ import annotations

import pkgutil

# Hook targets, SGLang 0.5.23 (file:line of each definition), by the name of their replacement in
# kvprobe.targets.shadow.sglang.hooks.
TARGETS = {
    "load_model": "sglang.srt.model_executor.model_runner.ModelRunner.load_model",  # model_runner.py L1270
    "profile_available_bytes": "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
                               "_profile_available_bytes",  # kv_cache_configurator.py L2990
    "init_attention_backends": "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends",  # L1105
    "init_cuda_graphs": "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs",  # L1170
    # tp_worker.py L622
    "forward_batch_generation": "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
    "update_penalties": "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.update_penalties",  # L410
}


# SGLang 0.5.21 defines the same six targets with the same signatures (model_runner.py L1184, L1005, L1078;
# kv_cache_configurator.py L2177, the same KV budget formula; tp_worker.py L598, without 0.5.23's
# `return_kv_loc_plan`, which the replacement takes with a default; sampling_batch_info.py L358), and its
# plugins/ package is 0.5.23's: the plugin needs no adaptation keyed on the version (docs/shadow.md, Releases).
# SGLang 0.5.22 likewise (model_runner.py L1251, L1083, L1156; kv_cache_configurator.py L2671, the same formula;
# tp_worker.py L603, already with `return_kv_loc_plan`; sampling_batch_info.py L409), plugins/ 0.5.23's.
VERSIONS = ("0.5.21", "0.5.22", "0.5.23")


def applied(target: str, fn) -> bool:
    """Whether `target` now calls `fn`: a REPLACE wrapper (hook_registry.py `_wrap_fn`) holds the hook
    in its closure."""
    owner, _, attr = target.rpartition(".")
    current = getattr(pkgutil.resolve_name(owner), attr, None)
    return any(cell.cell_contents is fn for cell in (getattr(current, "__closure__", None) or ()))
