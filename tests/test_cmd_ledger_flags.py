"""`kvprobe ledger`: options generated from the dialects' flag tables, the same
names and meaning as an expectation's flags, a refusal explained after every table, pools labelled
by what sized them, versions kvprobe has no facts for refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvprobe.cli.main import build_parser, main
from kvprobe.engines import get_dialect
from kvprobe.engines.base import render_flags
from kvprobe.spec.expectation import ledger_inputs, load_expectations
from kvprobe.theory.ledger.build import build_ledger

ROOT = Path(__file__).resolve().parents[1]
SEED_001 = ["--engine", "vllm", "--model", "meta-llama/Llama-3.1-8B", "--gpu-memory", "24GiB"]


def run(capsys, *argv):
    rc = main(["ledger", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def ledger_options() -> set[str]:
    parser = build_parser(["ledger"])
    sub = parser._subparsers._group_actions[0].choices["ledger"]
    return set(sub._option_string_actions)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_flag_an_expectation_accepts_is_an_option(engine):
    d = get_dialect(engine)
    options = ledger_options()
    wanted = {f"--{n}" for n in d.FLAGS if n not in ("served-model-name", "api-key")}
    wanted |= {f"--{n}" for n in d.OTHER_FLAGS}
    assert wanted <= options, sorted(wanted - options)


@pytest.mark.parametrize("name", ["emulated-vllm", "emulated-sglang"])
def test_an_expectations_flags_on_the_console_give_its_ledger(capsys, name):
    """The flags of a shipped expectation, rendered as the launcher renders them for the engine,
    give `kvprobe ledger` the same ledger as the expectation: same names, same meaning."""
    (exp,) = load_expectations(ROOT / "expectations" / f"{name}.yaml")
    d = get_dialect(exp.engine)
    argv = ["--engine", exp.engine, "--model", exp.model, "--engine-version", exp.version,
            "--prompt-tokens", str(exp.profile.request.prompt_tokens),
            "--output-tokens", str(exp.profile.request.output_tokens), "--json",
            *render_flags(exp.flags, d.FLAGS)]
    if exp.hardware.gpu_memory_bytes:
        argv += ["--gpu-memory", f"{exp.hardware.gpu_memory_bytes}B"]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    console = json.loads(out)
    from_file = build_ledger(ledger_inputs(exp)).to_dict()
    for key in ("budget", "capacity", "request", "admission", "scheduler_config"):
        assert console[key] == from_file[key], key


def test_seed_001_first_command_prints_every_table_then_the_refusal(capsys):
    rc, out, err = run(capsys, *SEED_001)
    assert rc == 1 and err == ""
    assert out.startswith("GPU memory 24 GiB as written\n\n")  # what --gpu-memory was read as, first
    positions = [out.index(h) for h in ("capacity ledger: vllm 0.33.0", "\nbudget ", "\ncapacity  ",
                                        "admission: not predicted", "finding: vllm 0.33.0 would refuse")]
    assert positions == sorted(positions)
    # vLLM's own text (theory/vllm/budget.py vllm_check_fits, checked against the fixture), then the fix
    assert "To serve at least one request with the model's max seq len (131072)" in out
    assert "the largest max-model-len that fits this pool: 48064 (--max-model-len 48064)" in out
    rc, out, _ = run(capsys, *SEED_001, "--max-model-len", "48064")
    assert rc == 0 and "finding" not in out
    rc, out, _ = run(capsys, *SEED_001, "--max-model-len", "48065")
    assert rc == 1 and "48064" in out


def test_refusal_in_json_under_startup(capsys):
    rc, out, _ = run(capsys, *SEED_001, "--prompt-tokens", "512", "--output-tokens", "256", "--json")
    d = json.loads(out)
    assert rc == 1 and d["admission"] is None and d["capacity"]["num_blocks"] == 3005
    assert d["startup"]["refused"] is True and d["startup"]["largest_max_model_len"] == 48064
    assert d["startup"]["message"].startswith("To serve at least one request")
    rc, out, _ = run(capsys, *SEED_001, "--max-model-len", "8192", "--json")
    assert rc == 0 and json.loads(out)["startup"] == {"refused": False}


def test_pool_labelled_by_its_true_source(capsys):
    rc, out, _ = run(capsys, *SEED_001, "--max-model-len", "4096", "--num-gpu-blocks-override", "1000")
    assert rc == 0
    pool = next(line for line in out.splitlines() if line.startswith("= KV pool"))
    assert "1.95 GiB" in pool and "num-gpu-blocks-override: 1000 blocks x 2.00 MiB" in pool
    assert "profiled pool" in out  # the memory-derived figure is still shown, named for what it is
    rc, out, _ = run(capsys, *SEED_001, "--max-model-len", "4096", "--kv-cache-memory-bytes", "4GiB")
    budget = next(block for block in out.split("\n\n") if block.startswith("budget"))
    assert "= KV pool    4.00 GiB  kv-cache-memory-bytes" in budget
    assert "0.92" not in budget and "requested" not in budget.replace("(given: no memory", "")
    rc, out, _ = run(capsys, *SEED_001, "--max-model-len", "4096")
    assert "profiled: requested - weights" in out


def test_engine_versions_without_facts_need_a_policy(capsys):
    rc, out, err = run(capsys, *SEED_001, "--max-model-len", "4096", "--engine-version", "9.9.9")
    assert rc == 2 and "--policy (vllm-0.33, vllm-0.11, worst-case)" in err
    rc, out, err = run(capsys, *SEED_001, "--max-model-len", "4096", "--engine-version", "9.9.9",
                       "--policy", "vllm-0.33", "--prompt-tokens", "512", "--output-tokens", "256")
    assert rc == 0 and "vllm-0.33" in out


def test_unread_flags_are_said_once(capsys):
    rc, out, err = run(capsys, *SEED_001, "--max-model-len", "4096", "--disable-log-stats", "--trust-remote-code",
                       "--watermark", "0.1")
    assert rc == 0 and "--disable-log-stats, --trust-remote-code not read by the ledger" in err
    assert "--watermark" not in err  # read from vLLM 0.24.0 on (theory/vllm/releases.py WATERMARK_FROM)


def test_aliases_and_engine_specific_spellings(capsys):
    base = ["--model", "meta-llama/Llama-3.1-8B", "--prompt-tokens", "128", "--output-tokens", "32", "--json"]
    rc, out, err = run(capsys, "--engine", "sglang", *base, "--max-total-tokens", "3300",
                       "--context-length", "2048", "--tensor-parallel-size", "1")
    assert rc == 0, err
    assert json.loads(out)["admission"]["limit"] > 0
    rc, out, err = run(capsys, "--engine", "vllm", *base, "--num-gpu-blocks-override", "201",
                       "--max-model-len", "2048", "--device-memory-utilization", "0.8")
    assert rc == 0 and json.loads(out)["capacity"]["num_blocks"] == 201


def test_an_unknown_option_names_the_closest(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["ledger", *SEED_001, "--num-gpu-block-override", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "did you mean '--num-gpu-blocks-override'?" in err


def test_sglang_refusal_is_a_finding_after_every_table(capsys):
    """SGLang's start-up refusal (weights leave the pool nothing: kv_cache_configurator.py's
    `_profile_available_bytes`) is explained as vLLM's is: the tables, then the finding, exit 1."""
    argv = ("--engine", "sglang", "--model", "meta-llama/Llama-3.1-8B", "--gpu-memory", "16GiB")
    rc, out, err = run(capsys, *argv)
    assert rc == 1 and err == ""
    positions = [out.index(h) for h in ("capacity ledger: sglang 0.5.23", "\nbudget ", "\ncapacity  ",
                                        "admission: not predicted", "finding: sglang 0.5.23 would refuse")]
    assert positions == sorted(positions)
    assert "Raise --mem-fraction-static above 0.935 (weights 14.96 GiB per rank)" in out
    rc, out, _ = run(capsys, *argv, "--prompt-tokens", "512", "--output-tokens", "256", "--json")
    d = json.loads(out)
    assert rc == 1 and d["admission"] is None and d["startup"]["refused"] is True
    assert d["startup"]["message"].startswith("Loaded weights leave no GPU memory for the KV cache")
    rc, out, _ = run(capsys, *argv, "--mem-fraction-static", "0.95", "--json")  # the fix the finding names
    assert rc == 0 and json.loads(out)["startup"] == {"refused": False}
