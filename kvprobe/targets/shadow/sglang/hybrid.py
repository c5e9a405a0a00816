"""The SGLang shadow for hybrid models (sliding-window and recurrent layers): the options SGLang's
pool flags set, the memory the pools take on this machine, and the config.json the engine can load
on a CPU.

SGLang 0.5.23 keeps separate pools for these models (theory/sglang_pools.py says how and where):
a full-attention token pool, a sliding-window token pool (gpt-oss, Llama 4) or a pool of
recurrent-state slots (Qwen3-Next). The shadow lets SGLang's own configurator size them — the plugin
hands it a budget (`sglang_hooks.profile_available_bytes`, which also applies SGLang's own
`_handle_max_mamba_cache`) — and the ledger's budget (theory/sglang/budget.py `sglang_budget` with these
options: `SglangBudget.pools`) is kvprobe's prediction, used for the memory check and by the tests,
which compare it with what SGLang logs.
"""

from __future__ import annotations

import dataclasses

from kvprobe.engines import sglang as dialect
from kvprobe.errors import ConfigError
from kvprobe.theory.sglang.pools import SglangOptions, SglangPools

# SglangOptions' fields are LedgerInputs' names: a dialect flag that sets one (`Flag.ledger`) sets the other
_OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(SglangOptions))


def _parse(name: str, value, kind):
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"expected true or false, got {value!r}", key=f"flags.{name}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"expected {kind.__name__}, got {value!r}", key=f"flags.{name}") from None


def options(flags: dict[str, object]) -> SglangOptions:
    """SglangOptions from the launch's flags (SGLang's names, values as given)."""
    kw = {flag.ledger: _parse(name, flags[name], flag.type or bool) for name, flag in dialect.FLAGS.items()
          if flag.ledger in _OPTION_FIELDS and flags.get(name) is not None}
    return SglangOptions(**kw)


def engine_config(config: dict) -> dict:
    """The config.json SGLang loads on a CPU: a quantization it registers only on GPUs left out
    (dialect.CPU_UNREGISTERED_QUANTIZATION)."""
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") in dialect.CPU_UNREGISTERED_QUANTIZATION:
        return {k: v for k, v in config.items() if k != "quantization_config"}
    return config


def pool_bytes(pools: SglangPools) -> int:
    """Real buffers of the pools: K and V of every full layer per full token, of every window layer
    per window token, and (slots + 1) state slots (the +1 is SGLang's padding slot, L3229-3409)."""
    total = pools.max_total_num_tokens * pools.full_bytes_per_token
    total += (pools.swa_tokens or 0) * pools.swa_bytes_per_token
    if pools.mamba_slots is not None:
        total += (pools.mamba_slots + 1) * pools.layout.mamba_cache_per_req
    return total
