"""One release rule: the admission policy the ledger applies to a version is the one the emulator
applies (the engine dialect's `policy()`), for every known release and the ones between them."""

import pytest

from kvprobe.engines import get_dialect
from kvprobe.releases import KNOWN_VERSIONS
from kvprobe.theory.admission import policy_for
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.sglang import releases as sglang_releases
from kvprobe.theory.vllm import releases as vllm_releases

GIB = 2**30
BETWEEN = {"vllm": ("0.11.1", "0.12.0", "0.20.1"), "sglang": ("0.5.21.post1", "0.5.22")}
CASES = [(engine, v) for engine in ("vllm", "sglang") for v in (*KNOWN_VERSIONS[engine], *BETWEEN[engine])]


def _ledger_policy(engine: str, version: str, **kw) -> str:
    size = {"max_model_len": 8192} if engine == "vllm" else {"context_length": 8192}
    led = build_ledger(LedgerInputs(engine=engine, model="meta-llama/Llama-3.1-8B", gpu_memory_bytes=24 * GIB,
                                    engine_version=version, **size, **kw))
    return led.scheduler_config.policy


@pytest.mark.parametrize(("engine", "version"), CASES)
def test_the_ledger_and_the_emulator_apply_the_same_policy(engine, version):
    emulator = get_dialect(engine).policy(version)
    assert policy_for(engine, version) == emulator
    assert _ledger_policy(engine, version) == emulator


@pytest.mark.parametrize("version", (*KNOWN_VERSIONS["vllm"], *BETWEEN["vllm"]))
@pytest.mark.parametrize("reserve_full_isl", [True, False])
def test_vllm_reserve_full_isl_is_read_the_same_way(version, reserve_full_isl):
    emulator = get_dialect("vllm").policy(version, reserve_full_isl=reserve_full_isl)
    assert policy_for("vllm", version, reserve_full_isl=reserve_full_isl) == emulator
    assert _ledger_policy("vllm", version, reserve_full_isl=reserve_full_isl) == emulator


def test_the_release_rules():
    assert [vllm_releases.policy(v) for v in ("0.9.2", "0.11.0", "0.11.1", "0.12.0", "0.33.0")] == \
        ["vllm-0.11", "vllm-0.11", "vllm-0.11", "vllm-0.33", "vllm-0.33"]
    assert vllm_releases.policy("0.33.0", reserve_full_isl=False) == "vllm-0.11"
    assert [sglang_releases.policy(v) for v in ("0.5.21", "0.5.21.post1", "0.5.22", "0.5.23")] == \
        ["sglang-0.5.21", "sglang-0.5.21", "sglang-0.5.22", "sglang-0.5.22"]
