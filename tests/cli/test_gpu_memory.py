"""GPU memory as the user writes it: a unit is required and meant as written (GiB binary, GB
decimal), a card can be named instead (its memory as CUDA reports it), and the console says
which figure it read. Every face: `kvprobe ledger`, `kvprobe probe --url`, `kvprobe shadow vllm|sglang`."""

from __future__ import annotations

import pytest

from kvprobe.spec.gpus import GPUS, find_gpu
from tests.cli.console import run

LLAMA = ["--model", "meta-llama/Llama-3.1-8B"]
# each face with what it needs to reach its GPU option (none of these gets as far as an engine)
FACES = {
    "ledger": ["ledger", "--engine", "vllm", *LLAMA],
    "probe": ["probe", "--url", "http://127.0.0.1:9", "--engine", "vllm", "--prompt-tokens", "8",
              "--output-tokens", "8"],
    "shadow-vllm": ["shadow", "vllm", "meta-llama/Llama-3.1-8B"],
    "shadow-sglang": ["shadow", "sglang", "--model-path", "meta-llama/Llama-3.1-8B"],
}


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize(("written", "why"), [
    ("24", "'24' has no unit: write 24GiB (binary) or 24GB (decimal)"),
    ("24G", "'24G' has a one-letter unit, binary or decimal is not clear: write 24GiB (binary) or 24GB (decimal)"),
    ("24g", "'24g' has a one-letter unit, binary or decimal is not clear: write 24GiB (binary) or 24GB (decimal)"),
    ("24 bananas", "'24 bananas' has an unknown unit 'bananas': write 24GiB (binary) or 24GB (decimal)"),
    ("25769803776", "'25769803776' has no unit: write 25769803776B for bytes, or a size such as 24GiB (binary) "
                    "or 24GB (decimal)"),
])
def test_a_memory_size_without_a_clear_unit_is_bad_input(capsys, face, written, why):
    rc, out, err = run(capsys, *FACES[face], "--gpu-memory", written)
    assert rc == 2, (out, err)
    assert err.splitlines() == [f"kvprobe {FACES[face][0]}: error: --gpu-memory: {why}"], err


def test_gb_is_decimal_and_the_ledger_says_what_it_read(capsys):
    rc, out, _ = run(capsys, *FACES["ledger"], "--gpu-memory", "80GB", "--max-model-len", "8192")
    assert rc == 0
    assert out.startswith("GPU memory 80 GB = 74.51 GiB as written\n")
    assert any(line.split()[:4] == ["GPU", "memory", "74.51", "GiB"] for line in out.splitlines()), out
    rc, out, _ = run(capsys, *FACES["ledger"], "--gpu-memory", "80gib", "--max-model-len", "8192")
    assert rc == 0 and out.startswith("GPU memory 80 gib as written\n")
    assert any(line.split()[:4] == ["GPU", "memory", "80.00", "GiB"] for line in out.splitlines()), out


def test_a_gpu_by_name_is_its_memory_as_cuda_reports_it(capsys):
    rc, out, _ = run(capsys, *FACES["ledger"], "--gpu", "h100-80gb", "--max-model-len", "8192")
    assert rc == 0
    assert out.startswith("GPU H100-80GB (NVIDIA H100 80GB HBM3): memory 79.20 GiB as CUDA reports the card\n")
    budget = next(line for line in out.splitlines() if line.startswith("GPU memory"))
    assert "79.20 GiB" in budget, budget  # the ledger sizes from the card's figure, not from 80 GiB
    # nvidia-smi's name and kvprobe's name are the same card
    assert find_gpu("NVIDIA GeForce RTX 4090", key="--gpu") is find_gpu("rtx-4090", key="--gpu")


@pytest.mark.parametrize("face", FACES)
def test_an_unknown_gpu_lists_the_known_ones(capsys, face):
    rc, _, err = run(capsys, *FACES[face], "--gpu", "H900")
    assert rc == 2
    (line,) = err.splitlines()
    assert line.startswith(f"kvprobe {FACES[face][0]}: error: --gpu: unknown GPU 'H900': known GPUs are H100-80GB, ")
    assert all(g.name in line for g in GPUS)


@pytest.mark.parametrize("face", FACES)
def test_gpu_and_gpu_memory_together_is_bad_input(capsys, face):
    rc, _, err = run(capsys, *FACES[face], "--gpu", "L40S", "--gpu-memory", "48GB")
    assert rc == 2
    assert err.splitlines() == [f"kvprobe {FACES[face][0]}: error: --gpu: one of --gpu or --gpu-memory, not both "
                                "(--gpu L40S already says the card's memory)"]


def test_every_card_names_where_its_figure_was_read():
    assert len({g.name for g in GPUS}) == len(GPUS)
    for gpu in GPUS:
        assert gpu.source.startswith("https://github.com/"), gpu
        assert find_gpu(gpu.smi_name, key="--gpu") is gpu


@pytest.mark.parametrize("written", ["L40S", "NVIDIA L40S", "l40s"])
def test_an_expectation_names_its_gpu(tmp_path, written):
    from pathlib import Path

    import yaml

    from kvprobe.spec.expectation import load_expectations

    repo = Path(__file__).resolve().parents[2]
    exp = yaml.safe_load((repo / "expectations" / "emulated-vllm.yaml").read_text())
    exp["hardware"] = {"gpu": written, "count": 1}
    path = tmp_path / "l40s.yaml"
    path.write_text(yaml.safe_dump(exp))
    (loaded,) = load_expectations(path)
    assert (loaded.hardware.gpu_memory_bytes, loaded.hardware.name) == (47803596800, "L40S")
