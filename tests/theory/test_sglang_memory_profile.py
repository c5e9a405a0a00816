"""SGLang 0.5.0rc2-0.5.22's default memory budget, one rule per change, each pinned to a number worked by
hand from that release's own lines (server_args.py `_handle_gpu_memory_settings`, 0.5.19 on
arg_groups/memory_hook.py `handle_gpu_memory_settings`; the wheels from PyPI), not from kvprobe's code.

GPU totals are nvidia-smi's `memory.total` in MiB: RTX 4090 24,564; H100 80GB 81,559."""

from __future__ import annotations

import pytest

from kvprobe.errors import ConfigError
from kvprobe.releases import KNOWN_VERSIONS
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.sglang.memory_profile import RULES, memory_rules

MIB = 2**20
RTX_4090, H100 = 24_564, 81_559


def budget(version: str, gpu_mib: int | None, **kw):
    return build_ledger(LedgerInputs(engine="sglang", model="Qwen/Qwen3-8B", engine_version=version,
                                     gpu_memory_bytes=None if gpu_mib is None else gpu_mib * MIB,
                                     **({} if gpu_mib else {"max_total_tokens": 100_000}), **kw)).budget


@pytest.mark.parametrize(("version", "release"), [
    ("0.5.0rc2", "0.4.8"), ("0.5.1", "0.4.8"), ("0.5.1.post3", "0.4.8"), ("0.5.2", "0.4.8"),
    ("0.5.3", "0.5.3"), ("0.5.3.post3", "0.5.3"), ("0.5.4", "0.5.3"), ("0.5.4.post1", "0.5.4.post1"),
    ("0.5.9", "0.5.4.post1"), ("0.5.10", "0.5.10"), ("0.5.15.post1", "0.5.10"), ("0.5.19", "0.5.10"),
    ("0.5.20", "0.5.20"), ("0.5.21", "0.5.20"), ("0.5.22", "0.5.22"), ("0.5.23", "0.5.23")])
def test_each_0_5_release_takes_the_rules_of_the_release_that_changed_them(version, release):
    assert memory_rules(version).release == release


def test_every_known_0_5_release_has_rules():
    for version in KNOWN_VERSIONS["sglang"]:
        assert memory_rules(version) in RULES


@pytest.mark.parametrize(("version", "gpu_mib", "tp", "fraction", "chunked", "max_bs"), [
    # 0.4.8-0.5.2: reserved (9.5 + tp/2) GiB below 90 GiB: (81559 - 10240) / 81559 = 0.8744
    ("0.5.1", H100, 1, 0.874, 8192, 160),
    ("0.5.2", H100, 8, 0.831, 8192, 160),  # (81559 - 13824) / 81559 = 0.8305
    # 0.5.3: 512 + 2048 x 1.5 + 16 x 2 + 1024 / 8 = 3744 MiB: (24564 - 3744) / 24564 = 0.8476
    ("0.5.3", RTX_4090, 1, 0.848, 2048, 16),
    ("0.5.4", RTX_4090, 4, 0.827, 2048, 80),  # tp 4: 512 + 3072 + 80 x 2 + 512 = 4256 MiB: 0.8267
    # 0.5.4.post1: cuda_graph_max_bs 24 at tp < 4: 3760 MiB: 0.8469
    ("0.5.4.post1", RTX_4090, 1, 0.847, 2048, 24),
    # 0.5.10: + 42 prefill graph sizes (4..2048) x 8 MiB = 336: 4096 MiB: 0.8333
    ("0.5.10", RTX_4090, 1, 0.833, 2048, 24),
    # H100: 512 + 8192 x 1.5 + 256 x 2 + 128 + 58 graph sizes (4..8192) x 8 = 13904 MiB: 0.8295
    ("0.5.10", H100, 1, 0.830, 8192, 256),
    # 0.5.20: chunked 4096, max_bs 48: 512 + 6144 + 96 + 128 + 50 x 8 = 7280 MiB: 0.7036
    ("0.5.20", RTX_4090, 1, 0.704, 4096, 48),
    ("0.5.19", RTX_4090, 1, 0.833, 2048, 24),
])
def test_the_default_fraction_is_the_release_s_own(version, gpu_mib, tp, fraction, chunked, max_bs):
    b = budget(version, gpu_mib, tp=tp)
    assert (b.fraction, b.chunked_prefill_size, b.cuda_graph_max_bs) == (fraction, chunked, max_bs)


def test_without_a_gpu_the_fraction_is_0_88_until_0_5_20_then_0_95():
    assert [budget(v, None).fraction for v in ("0.5.3", "0.5.10", "0.5.19", "0.5.20", "0.5.22")] == \
        [0.88, 0.88, 0.88, 0.95, 0.95]


def test_max_running_requests_lowers_a_defaulted_decode_graph_batch_from_0_5_22():
    """0.5.22 added the clamp: 256 -> 16 takes 480 MiB off the 13904 MiB reserve on an H100."""
    old, new = (budget(v, H100, max_running_requests=16) for v in ("0.5.21", "0.5.22"))
    assert (old.cuda_graph_max_bs, old.fraction) == (256, 0.830)
    assert (new.cuda_graph_max_bs, new.fraction) == (16, 0.835)  # (81559 - 13424) / 81559 = 0.8354


def test_a_formula_release_has_no_table_fraction():
    with pytest.raises(ConfigError, match="sglang_default_mem_fraction_static"):
        memory_rules("0.5.10").default_fraction(H100)
