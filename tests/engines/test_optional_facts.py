"""Optional dialect facts are declared once, in engines/base.py, with their defaults."""

from __future__ import annotations

import types

from kvprobe.engines import get_dialect
from kvprobe.engines.base import OptionalFacts, ReportedCapacity


def test_every_dialect_has_every_optional_fact():
    for name in ("vllm", "sglang"):
        d = get_dialect(name)
        for fact in OptionalFacts.names():
            assert hasattr(d, fact), (name, fact)


def test_a_dialect_that_leaves_a_fact_out_gets_the_default():
    bare = OptionalFacts.apply(types.ModuleType("bare"))
    assert bare.RUNNING_GAUGE_EXACT is True and bare.FIRST_TOKEN_LEAD_STEPS == 1
    assert bare.length_limit(ReportedCapacity(max_model_len=10)) is None
    assert bare.parse_startup_log("anything") == ReportedCapacity()


def test_a_fact_the_dialect_writes_wins():
    assert get_dialect("sglang").RUNNING_GAUGE_EXACT is False
