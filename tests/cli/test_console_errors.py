"""Bad input on the console: exit 2 and the one useful line first, whatever the input was (a URL
without its scheme, an unset API-key variable, a count, an unknown option); help in the user's
words; `kvprobe shadow list` in aligned columns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cli.console import run

BARE = ["probe", "--engine", "vllm", "--prompt-tokens", "8", "--output-tokens", "8"]
EXPECTATION = str(Path(__file__).resolve().parents[2] / "expectations" / "emulated-vllm.yaml")


@pytest.mark.parametrize("argv", [[*BARE, "--url", "localhost:8000"],
                                  ["probe", EXPECTATION, "--url", "localhost:8000"]], ids=["bare", "with-a-file"])
def test_a_url_without_its_scheme_is_bad_input(capsys, argv):
    rc, out, err = run(capsys, *argv)
    assert rc == 2, (out, err)
    assert err.splitlines() == ["kvprobe probe: error: --url: expected an http:// or https:// URL with a host, "
                                "got 'localhost:8000': write http://localhost:8000"]


def test_an_unset_api_key_variable_is_bad_input(capsys, monkeypatch):
    monkeypatch.delenv("KVPROBE_TEST_NO_SUCH_KEY", raising=False)
    rc, _, err = run(capsys, *BARE, "--url", "http://127.0.0.1:9", "--api-key-env", "KVPROBE_TEST_NO_SUCH_KEY")
    assert rc == 2
    assert err.splitlines() == ["kvprobe probe: error: --api-key-env: the environment variable "
                                "'KVPROBE_TEST_NO_SUCH_KEY' that should hold the engine's API key is not set or empty "
                                "(export KVPROBE_TEST_NO_SUCH_KEY=... before running kvprobe)"]


def test_a_count_error_shows_what_its_examples_parse_to(capsys):
    rc, _, err = run(capsys, "ledger", "--engine", "vllm", "--model", "meta-llama/Llama-3.1-8B",
                     "--gpu-memory", "24GiB", "--max-model-len", "-5")
    assert rc == 2
    assert err.splitlines() == ["kvprobe ledger: error: --max-model-len: expected a count like 2048, '2k' (2000) "
                                "or '2K' (2048), got '-5'"]


@pytest.mark.parametrize(("argv", "first"), [
    (["probe", "--no-such-option"], "kvprobe probe: error: unrecognized arguments: --no-such-option"),
    (["probe", "--budget", "soon"], "kvprobe probe: error: argument --budget: invalid float value: 'soon'"),
    (["ledger", "--engine", "vllm"], "kvprobe ledger: error: the following arguments are required: --model"),
    (["shadow", "vllm"], "kvprobe shadow vllm: error: the following arguments are required: model"),
])
def test_a_usage_error_is_its_one_line_and_a_hint(capsys, argv, first):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    lines = err.splitlines()
    assert lines[0].startswith(first), err
    prog = first.split(": error")[0]
    assert lines[1:] == [f"({prog} --help for the options)"], err


_SOURCE_TALK = re.compile(r"\bL\d{2,}\b|\.py\b|::|None ->|dialect|schedsim")


@pytest.mark.parametrize("command", [["ledger"], ["probe"], ["emulate", "vllm"], ["emulate", "sglang"],
                                     ["shadow", "vllm"], ["shadow", "sglang"]], ids=" ".join)
def test_help_is_in_the_users_words(capsys, command):
    rc, out, _ = run(capsys, *command, "--help")
    assert rc == 0
    said = [line for line in out.splitlines() if _SOURCE_TALK.search(line)]
    assert said == [], "\n".join(said)


def test_shadow_list_is_aligned(capsys):
    rc, out, _ = run(capsys, "shadow", "list")
    assert rc == 0
    header, rule, *rows, total = out.splitlines()[1:]
    assert header.split() == ["environment", "state", "own", "shared", "folder"]
    column = header.index("state")
    assert rows and all(row[column - 2:column] == "  " and row[column] != " " for row in rows), out
    assert "on disk, each file once:" in total  # hard-linked files counted once (kvprobe shadow share)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_emulator_serves_a_model_probe_url_knows(engine):
    """`kvprobe emulate ENGINE` then `kvprobe probe --url ... --engine ENGINE` (README, docs/emulator.md):
    the emulator's default served name is a packaged preset, so the probe finds the model's geometry."""
    from kvprobe.cli.main import build_parser
    from kvprobe.spec.attach import preset_for

    args = build_parser(["emulate", engine]).parse_args(["emulate", engine])
    assert preset_for(args.model) == (args.model, args.model)


def test_probe_without_its_inputs_says_it_once(capsys):
    rc, _, err = run(capsys, "probe")
    assert rc == 2
    assert err.splitlines() == ["kvprobe probe: error: expected an expectation file, or --url, --engine, "
                                "--prompt-tokens, --output-tokens to probe a running engine"]


@pytest.mark.parametrize("url", ["bob:s3cret@host:8000", "ftp://bob:s3cret@host:8000"])
def test_a_bad_url_is_never_echoed_with_its_credentials(capsys, url):
    rc, _, err = run(capsys, *BARE, "--url", url)
    assert rc == 2 and "s3cret" not in err and "***@host:8000" in err, err
