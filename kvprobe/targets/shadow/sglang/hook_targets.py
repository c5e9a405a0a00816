"""What kvprobe's SGLang plugin replaces: the dotted targets of its six hooks, and how to tell that
SGLang applied one. Standard library only: the plugin (in every SGLang process) and the hooks (torch
and SGLang) both read it.
"""

from __future__ import annotations

import pkgutil

from kvprobe.targets.shadow.sglang import compat

# Hook targets, SGLang 0.5.23 (file:line of each definition), by the name of their replacement in
# kvprobe.targets.shadow.sglang.hooks.
TARGETS = {
    "load_model": "sglang.srt.model_executor.model_runner.ModelRunner.load_model",  # model_runner.py L1270
    "profile_available_bytes": compat.CONFIGURATOR_BUDGET,  # kv_cache_configurator.py L2990
    "init_attention_backends": "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends",  # L1105
    "init_cuda_graphs": "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs",  # L1170
    # tp_worker.py L622
    "forward_batch_generation": "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
    "update_penalties": "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.update_penalties",  # L410
}


# The releases with a recipe (env.py), each read in its wheel. 0.5.16-0.5.22 define the same six targets with
# the same signatures, 0.5.14 and 0.5.15.post1 all but the budget (the runner's mixin's), and `plugins/` is
# 0.5.23's in each (0.5.20's byte for byte, the others' up to formatting):
#   0.5.22 model_runner.py L1251, L1083, L1156; kv_cache_configurator.py L2671; tp_worker.py L603; sampling L409
#   0.5.21 model_runner.py L1184, L1005, L1078; kv_cache_configurator.py L2177; tp_worker.py L598; sampling L358
#   0.5.20 model_runner.py L1162, L1013, L1086; kv_cache_configurator.py L2148; tp_worker.py L593; sampling L283
#   0.5.19 model_runner.py L1124, L993, L1061;  kv_cache_configurator.py L1990; tp_worker.py L593; sampling L267
#   0.5.18 model_runner.py L1049, L919, L984;   kv_cache_configurator.py L1764; tp_worker.py L574; sampling L266
#   0.5.17 model_runner.py L1008, L881, L943;   kv_cache_configurator.py L1614; tp_worker.py L558; sampling L267
#   0.5.16 model_runner.py L902, L819, L838;    kv_cache_configurator.py L1527; tp_worker.py L529; sampling L263
#   0.5.15.post1 model_runner.py L1422, L894, L922; model_runner_kv_cache_mixin.py L104; tp_worker.py L489;
#          sampling L249
#   0.5.14 model_runner.py L1335, L859, L887;   model_runner_kv_cache_mixin.py L85;   tp_worker.py L482; sampling L249
# (load_model, init_attention_backends, init_cuda_graphs; then the budget, the forward, update_penalties); in
# 0.5.14-0.5.16 the budget and what the hooks read beside the targets differ: compat.py, the one version branch.
# tp_worker's forward_batch_generation lacks 0.5.22's keyword `return_kv_loc_plan` through 0.5.21 (the
# replacement takes it with a default) and `capture_hidden_mode` through 0.5.15.post1 (likewise).
VERSIONS = ("0.5.14", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22",
            "0.5.23")


def targets(version: tuple[int, ...]) -> dict[str, str]:
    """TARGETS as that release (compat.release) defines them: only the budget's owner moved."""
    return {**TARGETS, "profile_available_bytes": compat.budget_target(version)}


def applied(target: str, fn) -> bool:
    """Whether `target` now calls `fn`: a REPLACE wrapper (hook_registry.py `_wrap_fn`) holds the hook
    in its closure."""
    owner, _, attr = target.rpartition(".")
    current = getattr(pkgutil.resolve_name(owner), attr, None)
    return any(cell.cell_contents is fn for cell in (getattr(current, "__closure__", None) or ()))
