"""Where the SGLang releases kvprobe's plugin runs in differ in what its hooks replace or read: the one
place that branches on the installed SGLang's version (`hook_targets.targets` and `hooks.py` ask here).
Standard library only; the functions that read SGLang import it when called (inside the engine
environment).

Releases with a shadow recipe: 0.5.14 to 0.5.23 (`env.py`). Read in each wheel (`pip download
sglang==V --no-deps`, files under sglang/srt/), 0.5.23 first, then the older releases:

- The KV budget, `_profile_available_bytes(self, pre_model_load_memory)`, is a method of
  `mem_cache/kv_cache_configurator.KVCacheConfigurator` from 0.5.16 (L1527 in 0.5.16, L2990 in 0.5.23)
  / of the model runner's mixin `model_executor/model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin`
  through 0.5.15.post1 (L104; 0.5.14 L85), with the same formula and signature.
  -> `budget_target`
- The resolved `mem_fraction_static` it reads: `runtime_context.get_schedule().mem_fraction_static` from
  0.5.17 (kv_cache_configurator.py L1625 in 0.5.17) / `self.server_args.mem_fraction_static` in 0.5.16
  (L1538; 0.5.16 has no `get_schedule`) / the runner's own `self.mem_fraction_static` through 0.5.15.post1
  (model_runner_kv_cache_mixin.py L116, set from the tp worker in model_runner.py L368 of 0.5.14).
  -> `mem_fraction_static`
- The recurrent-state share of the budget is `self._handle_max_mamba_cache` from 0.5.16 (L1703) /
  `self.handle_max_mamba_cache` through 0.5.15.post1 (model_runner_kv_cache_mixin.py L141; 0.5.14 L122).
  -> `less_mamba_state`, `max_mamba_cache_size`
- The window the runner keeps, `resolve_sliding_window_size(model, model_config)` in
  `model_executor/model_runner_components/load_model_utils.py` from 0.5.16 (L111; 0.5.23 L144) / the same
  three branches written inside `ModelRunner.load_model` through 0.5.15.post1 (model_runner.py L1556-1566;
  0.5.14 L1469-1479). -> `sliding_window_size`
- The native gRPC port: through 0.5.15.post1 ServerArgs always derives it as `--port + 10000` unless
  SGLANG_GRPC_PORT is set, and refuses one above 65535 (server_args.py L2761-2769 of 0.5.14, L2997-3005 of
  0.5.15.post1), so an HTTP port above 55535 — which the launcher may pick — stops the start; the server
  itself runs only with SGLANG_ENABLE_GRPC (L2759, L2995). From 0.5.16 the port is derived only for a gRPC mode
  and SGLANG_GRPC_PORT turns the native server on (0.5.16 L3319-3334). -> `launch_environ` (kvprobe's side)

Everything else the six hooks touch has 0.5.23's names and signatures in every one of these releases
(`hook_targets.py` lists the lines), and `plugins/` differs from 0.5.23's only by formatting.
"""

from __future__ import annotations

import re
from importlib import metadata

BUDGET_IN_CONFIGURATOR_FROM = (0, 5, 16)  # kv_cache_configurator.py is new in 0.5.16
SCHEDULE_CONTEXT_FROM = (0, 5, 17)  # runtime_context.get_schedule is new in 0.5.17

CONFIGURATOR_BUDGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
RUNNER_BUDGET = ("sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin."
                 "_profile_available_bytes")


def release(version: str) -> tuple[int, ...]:
    """`0.5.15.post1` -> (0, 5, 15): a post release has its release's interfaces."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+", 1)[0])[:3])


def installed() -> tuple[int, ...]:
    """The SGLang of this process (the engine environment's)."""
    return release(metadata.version("sglang"))


def budget_in_configurator(version: tuple[int, ...]) -> bool:
    return version >= BUDGET_IN_CONFIGURATOR_FROM


UNUSED_GRPC_PORT = "50051"  # a valid port for a server that stays off (SGLANG_ENABLE_GRPC unset)


def launch_environ(version: str) -> dict[str, str]:
    """What the shadow launch adds to that release's environment."""
    return {} if budget_in_configurator(release(version)) else {"SGLANG_GRPC_PORT": UNUSED_GRPC_PORT}


def budget_target(version: tuple[int, ...]) -> str:
    """The dotted definition of `_profile_available_bytes` in that release."""
    return CONFIGURATOR_BUDGET if budget_in_configurator(version) else RUNNER_BUDGET


def mem_fraction_static(owner) -> float:
    """The resolved fraction `_profile_available_bytes` reads; `owner` is its `self`."""
    version = installed()
    if version >= SCHEDULE_CONTEXT_FROM:
        from sglang.srt.runtime_context import get_schedule

        return get_schedule().mem_fraction_static
    if budget_in_configurator(version):
        return owner.server_args.mem_fraction_static
    return owner.mem_fraction_static


def less_mamba_state(owner, rest_gb: float) -> float:
    """SGLang's own recurrent-state share (it sets max_mamba_cache_size and returns the rest)."""
    if budget_in_configurator(installed()):
        return owner._handle_max_mamba_cache(rest_gb)
    return owner.handle_max_mamba_cache(rest_gb)


def max_mamba_cache_size(owner) -> int:
    """The state slots `less_mamba_state` left: in the schedule context from 0.5.17, in server_args before
    (kv_cache_configurator.py L1640 of 0.5.16; model_runner_kv_cache_mixin.py L201 of 0.5.14)."""
    if installed() >= SCHEDULE_CONTEXT_FROM:
        from sglang.srt.runtime_context import get_schedule

        return get_schedule().max_mamba_cache_size
    return owner.server_args.max_mamba_cache_size


def sliding_window_size(model, model_config):
    """The window `load_model` leaves on the runner, by that release's own rule."""
    if budget_in_configurator(installed()):
        from sglang.srt.model_executor.model_runner_components.load_model_utils import resolve_sliding_window_size

        return resolve_sliding_window_size(model, model_config)
    # model_runner.py L1556-1566 (0.5.15.post1): the branches 0.5.16 moved into resolve_sliding_window_size
    if hasattr(model, "get_attention_sliding_window_size"):
        return model.get_attention_sliding_window_size()
    if model_config.is_hybrid_swa and model_config.sliding_window_size is not None:
        return model_config.sliding_window_size
    return model_config.attention_chunk_size
