"""`kvprobe ledger` through cli.main and a real subprocess; units.py and tables.py it relies on."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvprobe.cli.main import main
from kvprobe.errors import ConfigError
from kvprobe.releases import KNOWN_VERSIONS
from kvprobe.tables import format_cell, render_table
from kvprobe.units import format_bytes, parse_bytes, parse_count

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ["--model", "meta-llama/Llama-3.1-8B", "--gpu-memory", "24GiB"]


def run(capsys, *argv):
    rc = main(["ledger", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_vllm(capsys):
    rc, out, err = run(capsys, "--engine", "vllm", *LLAMA, "--max-model-len", "8k", "--prompt-tokens", "512",
                       "--output-tokens", "256", "--estimate", "activation_bytes=0", "--estimate",
                       "cudagraph_bytes=0", "--estimate", "other_bytes=0", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["capacity"]["num_blocks"] == 3646 and d["capacity"]["kv_tokens"] == 58_336
    assert d["capacity"]["max_model_len"] == 8000  # "8k" is vLLM's decimal kilo


def test_table_sglang(capsys):
    rc, out, _ = run(capsys, "--engine", "sglang", *LLAMA, "--chunked-prefill-size", "2048")
    assert rc == 0
    assert "0.831" in out and "capacity ledger: sglang" in out


@pytest.mark.parametrize("argv,match", [
    (["--engine", "vllm", "--model", "acme/Nope", "--gpu-memory", "24GiB"], "unknown model"),
    (["--engine", "vllm", *LLAMA[:2], "--gpu-memory", "24 parsecs"], "--gpu-memory"),
    (["--engine", "sglang", *LLAMA, "--max-num-seqs", "8"], "expected a sglang flag (--max-num-seqs is a vllm flag"),
    (["--engine", "vllm", *LLAMA, "--engine-version", "9.9.9"],
     ", ".join(KNOWN_VERSIONS["vllm"])),
    (["--engine", "vllm", *LLAMA, "--block-size", "many"], "--block-size: expected an integer"),
    (["--engine", "vllm", *LLAMA, "--max-model-len", "8192", "--prompt-tokens", "8000", "--output-tokens", "500"],
     "beyond max_model_len"),
    (["--engine", "vllm", *LLAMA, "--gpu-memory-utilization", "1.5"], "gpu-memory-utilization"),
    (["--engine", "vllm", *LLAMA, "--estimate", "activation_bytes"], "NAME=BYTES"),
])
def test_errors_exit_2_with_one_line(capsys, argv, match):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert match in err and err.count("\n") == 1 and err.startswith("kvprobe ledger: error: ")


def test_real_subprocess():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "kvprobe", "ledger", "--engine", "vllm", "--model", "zai-org/GLM-5.3",
         "--gpu-memory", "141GiB", "--tp", "8", "--kv-cache-dtype", "fp8_ds_mla", "--max-model-len", "131072",
         "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    model = json.loads(proc.stdout)["model"]
    assert model["kv_bytes_per_token"] == 53_940
    bad = subprocess.run([sys.executable, "-m", "kvprobe", "ledger", "--engine", "vllm", "--model", "x/y"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert bad.returncode == 2 and "unknown model" in bad.stderr


# ---- units.py


@pytest.mark.parametrize("text,value", [
    ("24GiB", 24 * 2**30), ("24 GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("512MiB", 512 * 2**20),
    ("10G", 10 * 2**30), ("10g", 10 * 10**9), ("1.5GiB", 3 * 2**29), (4096, 4096), ("4096", 4096),
    ("81559MiB", 81559 * 2**20), ("2KiB", 2048), ("1kb", 1000),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "24 parsecs", "-1", -1, "1.5", "GiB", True, "1.0000001KiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ConfigError, match="gpu_memory"):
        parse_bytes(text, key="gpu_memory")


@pytest.mark.parametrize("text,value", [("1k", 1000), ("1K", 1024), ("8192", 8192), (8192, 8192),
                                        ("25.6k", 25600), ("2M", 2 * 2**20)])
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["1KiB", "eight", "1.5", "-3"])
def test_parse_count_rejects(text):
    with pytest.raises(ConfigError, match="max_model_len"):
        parse_count(text, key="max_model_len")


def test_format_bytes():
    assert format_bytes(7_647_696_978) == "7.12 GiB"
    assert format_bytes(512 * 2**20) == "512.00 MiB"
    assert format_bytes(100) == "100 B"
    assert format_bytes(-3 * 2**40) == "-3.00 TiB"


# ---- tables.py


def test_render_table_aligns_numbers_right():
    text = render_table(["name", "tokens"], [["vllm", 58336], ["sglang", 15879]], title="pool")
    lines = text.splitlines()
    assert lines[0] == "pool"
    assert lines[1].split() == ["name", "tokens"]
    assert lines[3] == "vllm    58,336" and lines[4] == "sglang  15,879"
    assert set(lines[2].replace(" ", "")) == {"-"}


def test_render_table_explicit_align_and_errors():
    text = render_table(["a", "b"], [["x", "1"]], align="rl")
    assert text.splitlines()[-1] == "x  1"
    with pytest.raises(ValueError):
        render_table(["a"], [["x", "y"]])
    with pytest.raises(ValueError):
        render_table(["a"], [["x"]], align="q")


def test_format_cell():
    assert [format_cell(v) for v in (None, True, 1234567, 7.12109375, 2.0, "x")] == \
        ["-", "yes", "1,234,567", "7.1211", "2", "x"]


LONG = ["--engine", "vllm", "--model", "meta-llama/Llama-3.1-8B", "--num-gpu-blocks-override", "6000",
        "--max-model-len", "16384", "--max-num-seqs", "1024", "--max-num-batched-tokens", "8192",
        "--prompt-tokens", "1000", "--output-tokens", "8000", "--users", "60"]


def test_async_scheduling_default_and_flags(capsys):
    modes = {}
    for flag in ((), ("--async-scheduling",), ("--no-async-scheduling",)):
        rc, out, err = run(capsys, *LONG, *flag, "--json")
        assert rc == 0, err
        d = json.loads(out)
        modes[flag] = (d["scheduler_config"]["async_scheduling"], d["admission"]["async_scheduling"])
        assert 18.5 <= d["admission"]["running"] <= 19.5 and "lifetimes" in d["admission"]["how"]
    assert modes[()] == (True, True)  # vLLM 0.33.0 on a GPU
    assert modes[("--async-scheduling",)] == (True, True)
    assert modes[("--no-async-scheduling",)] == (False, False)
    rc, out, _ = run(capsys, *LONG, "--engine-version", "0.11.0")
    assert rc == 0 and "sync" in out


def test_shared_prefix_tokens_with_and_without_prefix_caching(capsys):
    base = ["--engine", "sglang", "--model", "meta-llama/Llama-3.1-8B", "--max-total-tokens", "16384",
            "--context-length", "8192", "--prompt-tokens", "512", "--output-tokens", "256", "--json"]
    limits = {}
    for extra in ((), ("--shared-prefix-tokens", "384"), ("--shared-prefix-tokens", "384", "--disable-radix-cache")):
        rc, out, err = run(capsys, *base, *extra)
        assert rc == 0, err
        limits[extra] = json.loads(out)["admission"]["limit"]
    assert limits[()] == 21 and limits[("--shared-prefix-tokens", "384")] > 40
    assert limits[("--shared-prefix-tokens", "384", "--disable-radix-cache")] == 21
    rc, out, err = run(capsys, *base, "--shared-prefix-tokens", "512")
    assert rc != 0 and "shared_prefix_tokens" in err


def test_sglang_radix_off_in_the_table(capsys):
    rc, out, _ = run(capsys, "--engine", "sglang", "--model", "meta-llama/Llama-3.1-8B", "--max-total-tokens", "16384",
                     "--context-length", "8192", "--prompt-tokens", "512", "--output-tokens", "4096",
                     "--disable-radix-cache")
    assert rc == 0
    row = next(line for line in out.splitlines() if line.startswith("admission limit"))
    assert row.split()[2] == "4" and "burst start settles at 3" in row


def test_sglang_gpt_oss_pools_in_the_table_and_json(capsys):
    """A hybrid sliding-window model on SGLang: both pools, each pool's request figures and the
    binding pool, in the text and under capacity/request/admission `groups` in --json."""
    argv = ["--engine", "sglang", "--model", "openai/gpt-oss-20b", "--max-total-tokens", "30000", "--context-length",
            "8192", "--prompt-tokens", "2000", "--output-tokens", "1000", "--disable-radix-cache"]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    assert "  swa pool (window 127)    24,000  tokens; 12 layers" in out and "binding limit: kv (full pool)" in out
    rc, out, err = run(capsys, *argv, "--json")
    d = json.loads(out)
    assert [g["tokens"] for g in d["capacity"]["groups"]] == [30000, 24000]
    assert d["admission"]["binding_group"] == "full pool"
    assert [g["blocks_peak"] for g in d["request"]["groups"]] == [2999, 2001]
    rc, out, err = run(capsys, *argv[:-1])  # the radix cache on (sched_sglang_swa_radix): predicted too
    assert rc == 0 and "not predicted" not in out and "binding limit: kv (full pool)" in out
    assert re.search(r"admission limit +9\.98 ", out)
