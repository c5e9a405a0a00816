"""The SGLang shadow for hybrid models (sliding-window and recurrent layers): the options SGLang's
pool flags set, the memory the pools take on this machine, and the config.json the engine can load
on a CPU.

SGLang 0.5.23 keeps separate pools for these models (theory/sglang/pools.py says how and where):
a full-attention token pool, a sliding-window token pool (gpt-oss, Llama 4) or a pool of
recurrent-state slots (Qwen3-Next). The shadow lets SGLang's own configurator size them — the plugin
hands it a budget (`sglang_hooks.profile_available_bytes`, which also applies SGLang's own
`_handle_max_mamba_cache`) — and the ledger's budget (theory/sglang/budget.py `sglang_budget` with these
options: `SglangBudget.pools`) is kvprobe's prediction, used for the memory check and by the tests,
which compare it with what SGLang logs.
"""

from __future__ import annotations

from kvprobe.engines import sglang as dialect
from kvprobe.engines.sglang.hybrid_options import options  # noqa: F401 — the shadow reads its pool options here
from kvprobe.theory.sglang.pools import SglangPools


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
