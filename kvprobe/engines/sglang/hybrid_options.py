"""SGLang's hybrid-pool flags as the theory's `SglangOptions` (the same mapping for the shadow's and
the emulator's pools, and for the ledger through `Flag.ledger`): --swa-full-tokens-ratio,
--disable-hybrid-swa-memory, --max-mamba-cache-size, --mamba-full-memory-ratio,
--mamba-radix-cache-strategy, --mamba-ssm-dtype, --disable-radix-cache (SGLang 0.5.23,
srt/server_args.py)."""

from __future__ import annotations

import dataclasses

from kvprobe.engines.sglang.flags import FLAGS
from kvprobe.errors import ConfigError
from kvprobe.theory.sglang.pools import SglangOptions

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
    kw = {flag.ledger: _parse(name, flags[name], flag.type or bool) for name, flag in FLAGS.items()
          if flag.ledger in _OPTION_FIELDS and flags.get(name) is not None}
    return SglangOptions(**kw)
