"""kvprobe's SGLang plugin: the real SGLang serving stack with the model taken out.

SGLang 0.5.23 loads every entry point of the group `sglang.srt.plugins` early in each of its
processes (`sglang/srt/plugins/__init__.py::load_plugins`, called from `run_scheduler_process`
scheduler.py L6323, the detokenizer L552, the launcher engine.py L286; 0.5.21 from scheduler.py L6043
and engine.py L268 only, which is where the hooks act). kvprobe writes such an entry
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
| KVCacheConfigurator._profile_available_bytes | GPU profiling: a declared GPU's budget, or one no pool reaches (*) |
| ModelRunner.init_attention_backends | kernels: no backend |
| ModelRunner.init_cuda_graphs | graph capture: nothing captured |
| TpModelWorker.forward_batch_generation | the forward: one pseudo token per request after the modelled step time |
| SamplingBatchInfo.update_penalties | the penalizers' (batch x vocabulary) logit bias: no logits, no bias |

(*) so that `--max-total-tokens` sizes the pool.

The targets are 0.5.23's; of the older releases with a recipe (0.5.14-0.5.22) only the budget's owner
moved (ModelRunnerKVCacheMixin through 0.5.15.post1): `hook_targets.targets`, and `compat.py` for what
the hooks read around them.

This module is imported in every SGLang process: standard library only (with `settings` and
`hook_targets`, which are too); the hooks themselves (`hooks.py`, torch and SGLang) are imported only
when the plugin acts.
"""

from __future__ import annotations

import os

from kvprobe.targets.shadow.settings import ACTIVE_ENV
from kvprobe.targets.shadow.sglang.hook_targets import TARGETS, applied

# What a check of the installed environment reads here (tests/shadow_sglang/test_env.py).
__all__ = ["ACTIVE_ENV", "TARGETS", "active", "applied", "register", "replacements"]


def active() -> bool:
    return os.environ.get(ACTIVE_ENV) == "1"


def replacements() -> list[tuple[str, object]]:
    """(dotted target, replacement function) for the six hooks; imports the hooks (torch and SGLang)."""
    from kvprobe.targets.shadow.sglang import hooks

    return hooks.replacements()


def register() -> None:
    """Entry point (`sglang.srt.plugins`): register the replacements when kvprobe asked for them.
    SGLang applies them right after every plugin's register ran (`HookRegistry.apply_hooks`)."""
    if not active():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, fn in replacements():
        HookRegistry.register(target, fn, HookType.REPLACE)
