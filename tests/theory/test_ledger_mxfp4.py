"""The ledger of gpt-oss-20b on an 80 GiB GPU: its MXFP4 experts counted at their real bytes
(13,761,264,768 B = 12.82 GiB on Hopper, test_mxfp4.py), not 2 bytes a parameter (41.8 GB = 38.94
GiB, which left the KV pool 25 GiB short). Worked numbers, both engines, and `--gpu-arch`."""

from __future__ import annotations

import json

import pytest

from kvprobe.cli.main import main
from kvprobe.errors import ConfigError
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs

GPT_OSS = "openai/gpt-oss-20b"
GIB = 2**30
WEIGHTS_SM90 = 13_761_264_768  # the checkpoint's index total_size: no padding on Hopper
WEIGHTS_SM100 = 14_679_227_520  # + 24 layers x 32 experts x 1,195,264 B of Blackwell padding


def test_vllm_on_an_80_gib_hopper():
    """requested = ceil(80 GiB x 0.92) = 79,027,398,247; minus the weights, the 512 MiB context,
    the activation peak and graph pool estimates (2,968,518,656 and 315,621,376 B,
    budget.estimate_vllm_*_bytes, unchanged by this fix): 61,445,122,535 B, 156,263 blocks of 393,216 B
    (16 tokens x 12 layers x 2,048 B, one page per group layer)."""
    led = build_ledger(LedgerInputs(engine="vllm", model=GPT_OSS, gpu_memory_bytes=80 * GIB))
    b = led.budget
    assert b.requested_bytes == 79_027_398_247
    assert b.weights == WEIGHTS_SM90
    assert (b.other, b.activation, b.cudagraph) == (536_870_912, 2_968_518_656, 315_621_376)
    assert b.kv_pool_bytes == 79_027_398_247 - WEIGHTS_SM90 - 536_870_912 - 2_968_518_656 - 315_621_376
    assert b.kv_pool_bytes == 61_445_122_535  # 57.23 GiB (31.10 GiB with bf16 experts)
    assert b.bytes_per_block == 16 * 12 * 2048
    assert b.num_blocks == 61_445_122_535 // 393_216 == 156_263


def test_sglang_on_an_80_gib_hopper():
    """mem_fraction_static 0.83 by SGLang's formula for 80 GiB; 80 GiB x 0.83 - weights =
    57,535,192,345 B. The full pool takes 12 layers x 2,048 = 24,576 B a token and the window pool
    (0.8 of the full pool's tokens) the same: 57,535,192,345 / (24,576 x 1.8) = 1,300,618 tokens."""
    led = build_ledger(LedgerInputs(engine="sglang", model=GPT_OSS, gpu_memory_bytes=80 * GIB))
    b = led.budget
    assert b.fraction == 0.83 and b.weights == WEIGHTS_SM90
    assert b.kv_pool_bytes == int(80 * GIB * 0.83) - WEIGHTS_SM90 == 57_535_192_345  # 53.58 GiB
    assert b.max_total_num_tokens == 1_300_618 == int(57_535_192_345 / (24_576 * 1.8))


def test_gpt_oss_120b_fits_one_80_gib_gpu_as_its_model_card_says():
    """65,248,815,744 B of weights (60.77 GiB): vLLM keeps 79,027,398,247 - 65,248,815,744 -
    536,870,912 - 2,968,518,656 - 315,621,376 = 9,957,571,559 B for KV (16,882 blocks of 36 layers'
    / 2 groups' pages, 589,824 B); SGLang 80 GiB x 0.83 - weights = 6,047,641,369 B. With 2 bytes a
    parameter (233.7 GB) both refused to start."""
    vllm = build_ledger(LedgerInputs(engine="vllm", model="openai/gpt-oss-120b", gpu_memory_bytes=80 * GIB)).budget
    assert vllm.weights == 65_248_815_744
    assert vllm.kv_pool_bytes == 79_027_398_247 - 65_248_815_744 - 536_870_912 - 2_968_518_656 - 315_621_376
    assert vllm.bytes_per_block == 16 * 18 * 2048 and vllm.num_blocks == 9_957_571_559 // 589_824 == 16_882
    sgl = build_ledger(LedgerInputs(engine="sglang", model="openai/gpt-oss-120b", gpu_memory_bytes=80 * GIB)).budget
    assert sgl.kv_pool_bytes == int(80 * GIB * 0.83) - 65_248_815_744 == 6_047_641_369


def test_blackwell_padding_takes_its_bytes_from_the_pool():
    hop = build_ledger(LedgerInputs(engine="vllm", model=GPT_OSS, gpu_memory_bytes=80 * GIB)).budget
    bw = build_ledger(LedgerInputs(engine="vllm", model=GPT_OSS, gpu_memory_bytes=80 * GIB,
                                   gpu_arch="sm100")).budget
    assert bw.weights == WEIGHTS_SM100
    assert hop.kv_pool_bytes - bw.kv_pool_bytes == WEIGHTS_SM100 - WEIGHTS_SM90 == 917_962_752


def test_cli_gpu_arch_and_the_weights_row(capsys):
    rc = main(["ledger", "--engine", "sglang", "--model", GPT_OSS, "--gpu-memory", "80GiB", "--gpu-arch", "sm100",
               "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    d = json.loads(out)
    assert d["model"]["quantized_mxfp4"] is True
    assert d["model"]["weight_bytes"] == WEIGHTS_SM100 + 24 * 64 * 2  # float32 sinks under trtllm_mha
    rc = main(["ledger", "--engine", "vllm", "--model", GPT_OSS, "--gpu-memory", "80GiB"])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "12.82 GiB" in out and "MXFP4 experts" in out and "experts as vllm allocates them on sm90" in out


def test_cli_refuses_an_unknown_gpu_arch(capsys):
    with pytest.raises(SystemExit) as exc:  # argparse's choices
        main(["ledger", "--engine", "vllm", "--model", GPT_OSS, "--gpu-arch", "sm80"])
    assert exc.value.code == 2
    _, err = capsys.readouterr()
    assert "sm90" in err and "sm100" in err
    with pytest.raises(ConfigError, match="sm90, sm100") as cfg_err:  # the same through LedgerInputs
        build_ledger(LedgerInputs(engine="vllm", model=GPT_OSS, gpu_arch="sm80"))
    assert cfg_err.value.key == "gpu_arch"


def test_a_card_by_name_brings_its_family(tmp_path, capsys):
    """`--gpu L4` (hardware.gpu: L4) is an Ada card (compute capability 8.9): the ledger pads the
    experts for vLLM's MARLIN there as `--gpu-arch sm89` does, and an explicit `--gpu-arch` wins."""
    def weights(*extra):
        capsys.readouterr()
        assert main(["ledger", "--engine", "vllm", "--model", GPT_OSS, *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["budget"]["weights"]

    assert weights("--gpu", "L4") == weights("--gpu-memory", "23570219008B", "--gpu-arch", "sm89") == WEIGHTS_SM100
    assert weights("--gpu", "L4", "--gpu-arch", "sm90") == WEIGHTS_SM90
    assert weights("--gpu", "H100-80GB") == WEIGHTS_SM90
    from kvprobe.spec.expectation import ledger_inputs, load_expectations

    path = tmp_path / "l4.yaml"
    path.write_text("name: l4\nengine: vllm\nversion: '0.33.0'\nmodel: openai/gpt-oss-20b\n"
                    "hardware: {gpu: L4}\ntarget: {launch: engine}\nprofile: short\n")
    assert ledger_inputs(load_expectations(path)[0]).gpu_arch == "sm89"
