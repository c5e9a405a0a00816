"""repro.yaml without an engine: what an attached probe writes loads as an expectation of the shadow
(the reported pool as the override, the measured levels as an explicit ramp, what staging measured),
a bad `staging:` is refused naming its key, and a replay's plateau is compared with staging's."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from kvprobe.analysis.levels import LevelStats
from kvprobe.analysis.plateau import RejectionPoint
from kvprobe.engines import get_dialect
from kvprobe.engines.base import ReportedCapacity
from kvprobe.errors import ConfigError
from kvprobe.probe import repro
from kvprobe.probe.result import ProbeOptions, ProbeResult
from kvprobe.probe.run import predict
from kvprobe.probe.state import ProbeRun
from kvprobe.report.console import verdict_table
from kvprobe.spec.expectation import load_expectations
from kvprobe.spec.schema import StagingRecord, Target
from kvprobe.theory.model.geometry import PRESETS

REPO = Path(__file__).resolve().parents[2]


def level(users: int, running: float, preemptions: float | None = 0.0) -> LevelStats:
    return LevelStats(users=users, running_mean=running, running_max=running, waiting_mean=max(0.0, users - running),
                      waiting_max=users, usage_mean=0.9, usage_max=0.95, preemptions=preemptions,
                      preemption_rate_per_s=None, samples=40)


def attached_run(tmp_path, exp, reported: ReportedCapacity, levels, rejection: RejectionPoint,
                 url="http://staging:8000") -> ProbeRun:
    """A probe that attached to `url` and measured `levels` (what the steps leave in a ProbeRun)."""
    exp = replace(exp, target=Target("url", url=url))
    result = ProbeResult(expectation=exp, facts=SimpleNamespace(reported=reported), levels=levels,
                         rejection=rejection)
    return ProbeRun(exp=exp, options=ProbeOptions(artifacts_dir=tmp_path), artifacts=tmp_path, result=result,
                    ledger=None, dialect=get_dialect(exp.engine), deadline=0.0, target=object(), lifetime=2.6)


def plateau(rp: float | None, half: float | None, saturated: list[int]) -> RejectionPoint:
    return RejectionPoint(rejection_point=rp, last_clean_users=None, plateau=rp, saturated_levels=saturated,
                          usage_at_rejection=None, uncertainty=half)


def test_an_attached_vllm_probe_writes_a_shadow_expectation_with_the_reported_pool(tmp_path):
    exp = load_expectations(REPO / "expectations" / "emulated-vllm.yaml")[0]
    # the expectation said 201 blocks; the engine reports 1000: the replay takes the engine's
    exp = replace(exp, flags={**exp.flags, "served-model-name": "staging-llama", "kv-cache-memory-bytes": 2 << 30})
    levels = [level(10, 9.9), level(20, 19.7), level(29, 24.2, 21), level(33, 24.4, 17), level(38, 24.1, 19)]
    pr = attached_run(tmp_path, exp, ReportedCapacity(num_blocks=1000), levels, plateau(24.24, 0.74, [29, 33, 38]),
                      url="http://user:secret@staging:8000")
    repro.after_probe(pr)
    path = tmp_path / "repro.yaml"
    assert pr.result.repro == str(path)
    assert "secret" not in path.read_text()  # credentials in the URL are never written

    (loaded,) = load_expectations(path)
    assert (loaded.engine, loaded.version, loaded.model) == ("vllm", "0.33.0", "meta-llama/Llama-3.1-8B")
    assert loaded.target.mode == "shadow" and loaded.target.time_model["step_ms"] > 0
    assert loaded.flags["num-gpu-blocks-override"] == 1000
    assert "kv-cache-memory-bytes" not in loaded.flags  # the block override replaces the other pool flag
    assert "served-model-name" not in loaded.flags  # the shadow serves the model under its own id
    assert loaded.flags["max-num-seqs"] == 256 and loaded.flags["block-size"] == 16
    assert loaded.profile.ramp.strategy == "explicit" and loaded.profile.ramp.levels == (10, 20, 29, 33, 38)
    assert (loaded.profile.request.prompt_tokens, loaded.profile.request.output_tokens) == (128, 32)
    assert loaded.tolerances == exp.tolerances
    assert loaded.staging == StagingRecord(
        rejection_point=24.24, uncertainty=0.74, preemptions=57.0,
        running={10: 9.9, 20: 19.7, 29: 24.2, 33: 24.4, 38: 24.1}, url="http://***@staging:8000",
        result=str((tmp_path / "result.json").resolve()))


def test_the_card_staging_named_travels_with_the_file(tmp_path):
    """Qwen3-Next in "align" mode on an A100: 544-token blocks, no GDN checkpoint block (FlashInfer's prefill only
    on a Hopper). The replay names the card, so its shadow plans what staging's engine planned."""
    exp = load_expectations(REPO / "expectations" / "emulated-vllm.yaml")[0]
    exp = replace(exp, model="Qwen/Qwen3-Next-80B-A3B-Instruct",
                  flags={"num-gpu-blocks-override": 40, "max-model-len": 4096, "max-num-seqs": 16,
                         "max-num-batched-tokens": 512, "enable-prefix-caching": True, "block-size": 544},
                  hardware=replace(exp.hardware, name="A100-80GB"))
    levels = [level(4, 4.0), level(9, 6.4, 3), level(11, 6.4, 5)]
    pr = attached_run(tmp_path, exp, ReportedCapacity(num_blocks=40), levels, plateau(6.4, 0.2, [9, 11]))
    repro.after_probe(pr)
    (loaded,) = load_expectations(tmp_path / "repro.yaml")
    assert (loaded.hardware.name, loaded.hardware.capability) == ("A100-80GB", "8.0")
    assert predict(loaded).capacity.block_size == 544
    # with no card named, a Hopper: the published 544 raised to lcm(544, FlashInfer's 64-token grid) = 1088
    assert predict(replace(loaded, hardware=replace(loaded.hardware, name=None))).capacity.block_size \
        == 1088


def test_an_sglang_pool_is_the_token_cap_and_a_private_model_travels_with_the_file(tmp_path):
    (exp,) = [e for e in load_expectations(REPO / "expectations" / "shadow-sglang.yaml")
              if e.name == "shadow-sglang-kv"]
    config = tmp_path / "private" / "config.json"
    config.parent.mkdir()
    config.write_text((REPO / "kvprobe" / "theory" / "model" / "configs" / PRESETS[exp.model]).read_text())
    exp = replace(exp, model="acme/Private-8B", model_config=str(config), flags={**exp.flags, "max-total-tokens": None})
    art = tmp_path / "art"
    art.mkdir()
    pr = attached_run(art, exp, ReportedCapacity(kv_tokens=20480), [level(12, 12.0), level(28, 26.0), level(31, 26.1)],
                      plateau(26.05, 0.4, [28, 31]))
    repro.after_probe(pr)
    (loaded,) = load_expectations(art / "repro.yaml")
    assert loaded.flags["max-total-tokens"] == 20480 and loaded.flags["stream-interval"] == 8
    # 26 streams at once: read every step they would outrun the client, every 8 tokens they do not
    assert repro.shadow_step_ms(pr, {"stream-interval": 1}) > repro.shadow_step_ms(pr, loaded.flags)
    assert loaded.model == "acme/Private-8B"
    assert Path(loaded.model_base_dir, loaded.model_config).resolve() == (art / repro.MODEL_CONFIG_FILE).resolve()
    assert json.loads((art / repro.MODEL_CONFIG_FILE).read_text()) == json.loads(config.read_text())
    assert loaded.profile.ramp.levels == (12, 28, 31)


def test_a_launched_probe_writes_no_repro(tmp_path):
    exp = load_expectations(REPO / "expectations" / "emulated-vllm.yaml")[0]
    pr = attached_run(tmp_path, exp, ReportedCapacity(num_blocks=201), [level(10, 9.9)], plateau(None, None, []))
    pr = replace(pr, exp=replace(pr.exp, target=Target("emulator")))
    repro.after_probe(pr)
    assert pr.result.repro is None and not (tmp_path / "repro.yaml").exists()


def write_repro_file(tmp_path, staging: dict) -> Path:
    doc = yaml.safe_load((REPO / "expectations" / "shadow-vllm.yaml").read_text())
    doc["staging"] = staging
    path = tmp_path / "repro.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(("staging", "key", "expected"), [
    ({"rejection_point": 24, "plateau": 3}, "staging.plateau", "a known key of staging"),
    ({"uncertainty": 0.5}, "staging.rejection_point", "this key to be present"),
    ({"rejection_point": "many"}, "staging.rejection_point", "the measured plateau"),
    ({"rejection_point": 24, "running": [{"users": 10}]}, "staging.running[0].running", "this key to be present"),
])
def test_a_bad_staging_record_is_refused_naming_the_key(tmp_path, staging, key, expected):
    path = write_repro_file(tmp_path, staging)
    with pytest.raises(ConfigError) as err:
        load_expectations(path)
    assert str(path) in str(err.value) and key in str(err.value) and expected in str(err.value)


def replay(exp, rp, half, preemptions):
    levels = [level(29, rp, preemptions), level(38, rp, preemptions)]
    return ProbeResult(expectation=exp, levels=levels, rejection=plateau(rp, half, [29, 38]))


@pytest.mark.parametrize(("shadow", "half", "preemptions", "agrees", "said"), [
    (23.9, 0.7, 12.0, True, "within ±1.2"),
    (20.0, 0.3, 12.0, False, "outside ±1.2 even allowing for both uncertainties"),
    (22.5, 0.9, 12.0, None, "the uncertainties straddle ±1.2"),
    (24.1, 0.5, 0.0, False, "only staging preempted"),
])
def test_a_replay_is_compared_with_what_staging_measured(tmp_path, shadow, half, preemptions, agrees, said):
    path = write_repro_file(tmp_path, {"rejection_point": 24.24, "uncertainty": 0.74, "preemptions": 57})
    (exp,) = load_expectations(path)
    result = replay(exp, shadow, half, preemptions)
    result.staging = repro.compare(exp, result)
    assert result.staging["agrees"] is agrees and said in result.staging["reason"], result.staging
    assert result.to_dict()["staging"]["shadow_rejection_point"] == shadow
    word = {True: "AGREES", False: "DISAGREES", None: "UNDECIDED"}[agrees]
    assert f"staging: the shadow {word} with what staging measured" in verdict_table(result)


def test_a_replay_whose_load_generator_starved_is_not_compared(tmp_path):
    path = write_repro_file(tmp_path, {"rejection_point": 24.24, "uncertainty": 0.74, "preemptions": 57})
    (exp,) = load_expectations(path)
    result = replay(exp, 24.0, 0.5, 12.0)
    result.levels[1].client_saturated = True
    cmp = repro.compare(exp, result)
    assert cmp["agrees"] is None and "the load generator was the bottleneck at N=38" in cmp["reason"]


@pytest.mark.parametrize(("staged", "shadow", "agrees", "said"), [
    (None, None, True, "neither staging nor the shadow saturated a level"),
    (None, 24.0, False, "staging saturated no level; the shadow plateaus at 24.00"),
    (24.24, None, False, "the shadow saturated no level; staging measured 24.24"),
])
def test_a_level_that_saturated_on_one_side_only_is_a_disagreement(tmp_path, staged, shadow, agrees, said):
    (exp,) = load_expectations(write_repro_file(tmp_path, {"rejection_point": staged}))
    result = replay(exp, 20.0, None, 0.0)
    result.rejection = plateau(shadow, None, [] if shadow is None else [29, 38])
    cmp = repro.compare(exp, result)
    assert cmp["agrees"] is agrees and said in cmp["reason"], cmp
