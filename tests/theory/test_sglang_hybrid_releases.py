"""Which SGLang releases' hybrid pools the ledger models: 0.5.20 on (theory/sglang/budget.py
HYBRID_POOLS_READ_FROM; 0.5.20 sizes gpt-oss's pools and charges the window as 0.5.21 off
--enable-unified-memory, which the shadow pair expectations/diff/sglang-swa-budget-shadow.yaml confirmed),
refused before."""

from __future__ import annotations

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs


def ledger(version: str):
    return build_ledger(LedgerInputs(engine="sglang", model="openai/gpt-oss-20b", engine_version=version,
                                     context_length=2048, disable_radix_cache=True, max_total_tokens=4000))


def test_0_5_20_pools_are_0_5_21s():
    pools = [[(g["group"], g["tokens"]) for g in ledger(v).capacity.groups] for v in ("0.5.20", "0.5.21")]
    assert pools[0] == pools[1] == [("full pool", 4000), ("swa pool (window 127)", 3200)]


def test_0_5_19_hybrid_pools_are_refused():
    with pytest.raises(ConfigError, match=r"SGLang 0\.5\.19's hybrid pools are not read \(only 0\.5\.20-0\.5\.23's\)"):
        ledger("0.5.19")
