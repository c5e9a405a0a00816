"""vLLM's `--max-num-active-seqs` in the ledger: refused before 0.31.0 naming the release, a cap on
RUNNING from it (kvprobe/theory/vllm/releases.py ACTIVE_SEQS_FROM). No engine environment."""

import pytest

from kvprobe.errors import ConfigError
from kvprobe.spec.flags import flag_ledger_kwargs
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.vllm import releases

# shadow-vllm.yaml's shape: 1000 blocks of 16, P=512 O=256 -> 48 blocks at the peak, 20 fit at once
SHAPE = dict(engine="vllm", model="meta-llama/Llama-3.1-8B", num_gpu_blocks_override=1000, block_size=16,
             max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=2048, prompt_tokens=512,
             output_tokens=256)


def _ledger(version: str, active: int | None, **kw):
    return build_ledger(LedgerInputs(engine_version=version, max_num_active_seqs=active, **SHAPE), **kw)


@pytest.mark.parametrize("version", ["0.19.1", "0.30.0", "0.30.1"])
def test_a_release_before_0_31_refuses_the_flag_naming_itself(version):
    with pytest.raises(ConfigError, match=rf"vLLM {version} has no --max-num-active-seqs \(first in 0\.31\.0"):
        _ledger(version, 12)
    led = _ledger(version, 12, explain_refusal=True)
    assert led.refusal.startswith(f"vLLM {version} has no --max-num-active-seqs")
    assert led.admission is None
    assert any(name == "max_num_active_seqs" and "refused" in how for name, how in led.release_rules)


@pytest.mark.parametrize("version", ["0.31.0", "0.32.0", "0.33.0"])
def test_from_0_31_it_caps_running_below_the_kv_limit(version):
    led = _ledger(version, 12)
    assert led.refusal is None and led.capacity.max_running == 12
    assert led.scheduler_config.max_num_seqs == 12  # the simulated scheduler stops admitting at the cap
    assert led.admission.limit == pytest.approx(12, abs=0.01)
    rule = dict(led.release_rules)["max_num_active_seqs"]
    assert "0.31.0" in rule and "RUNNING capped at 12" in rule


def test_without_the_flag_every_release_runs_as_before():
    for version in ("0.30.0", "0.31.0"):
        led = _ledger(version, None)
        assert led.refusal is None and led.capacity.max_running == 256
        assert "max_num_active_seqs" not in dict(led.release_rules)
        assert led.admission.limit > 20  # the pool binds (~24 running)


def test_a_cap_above_max_num_seqs_is_the_engines_refusal():
    with pytest.raises(ConfigError, match=r"max_num_active_seqs \(300\) cannot be greater than max_num_seqs \(256\)"):
        _ledger("0.31.0", 300)


def test_the_rule_itself():
    assert releases.active_seqs_refusal("0.30.0", 256, None) is None
    assert releases.active_seqs_refusal("0.31.0", 256, 12) is None
    assert "vLLM 0.30.0" in releases.active_seqs_refusal("0.30.0", 256, 12)
    assert releases.running_cap(256, None) == 256 and releases.running_cap(256, 12) == 12


def test_the_flag_reaches_the_ledger():
    kw = flag_ledger_kwargs("vllm", {"max-num-active-seqs": 12, "max-num-seqs": 256}, "0.31.0")
    assert kw["max_num_active_seqs"] == 12 and kw["max_num_seqs"] == 256
