"""Bad input from the console: exit code 2 and exactly one stderr line naming the file, the key path
and what was expected — never a traceback, never a process started.

The broken files are the table of tests/test_spec_errors.py (one valid expectation + profile pair
with one thing broken each), run through `kvprobe probe` instead of the loader: most in-process
through `kvprobe.cli.main.main`, a handful through a real `python -m kvprobe` subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvprobe.cli import main as cli
from tests.test_spec_errors import CASES, Case, write_case

REPO = Path(__file__).resolve().parents[2]

# `kvprobe probe` takes one file; the directory-level case (duplicates across files) has no console
# form. Everything else must fail the same way from the console as from the loader.
CONSOLE_CASES = [c for c in CASES if c.load != "dir"]
SUBPROCESS_IDS = ("unknown-engine", "yaml-syntax", "length-vllm", "empty-ramp", "file-missing")


def test_an_in_process_console_probe_gives_sigterm_back(tmp_path, capsys):
    """`kvprobe probe` routes SIGTERM to KeyboardInterrupt while it runs, and only while it runs."""
    before = signal.getsignal(signal.SIGTERM)
    _, _, exp_path = write_case(tmp_path, Case("x", "", "", exp=lambda d: d.update(engine="tgi")))
    assert cli.main(["probe", str(exp_path), "--artifacts", str(tmp_path / "art")]) == 2
    assert signal.getsignal(signal.SIGTERM) is before


def expected_file(case: Case, exp_path: Path, profile_path: Path) -> Path:
    return profile_path if case.where == "profile" else exp_path


def assert_one_clear_line(err: str, *, file: Path, key: str, expect: str, absent: str | None = None) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert "Traceback" not in err
    assert line.startswith(f"kvprobe probe: error: {file}: "), line
    assert f": {key}" in line, line
    assert expect in line, line
    if absent:
        assert absent not in line, line


def test_the_console_table_is_large_enough():
    assert len(CONSOLE_CASES) >= 30


@pytest.mark.parametrize("case", CONSOLE_CASES, ids=[c.id for c in CONSOLE_CASES])
def test_console_probe_of_a_broken_file_exits_2_with_one_line(tmp_path, capsys, case):
    _, profile_path, exp_path = write_case(tmp_path, case)
    art = tmp_path / "art"
    code = cli.main(["probe", str(exp_path), "--artifacts", str(art)])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert_one_clear_line(err, file=expected_file(case, exp_path, profile_path), key=case.key,
                          expect=case.expect, absent=case.absent)
    assert not (art / "locust").exists() and not (art / "engine.log").exists()  # nothing was started


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_console_probe_of_an_unreadable_file(tmp_path, capsys):
    _, _, exp_path = write_case(tmp_path, Case("none", "", ""))
    exp_path.chmod(0)
    try:
        code = cli.main(["probe", str(exp_path), "--artifacts", str(tmp_path / "art")])
    finally:
        exp_path.chmod(0o644)
    _, err = capsys.readouterr()
    assert code == 2
    assert_one_clear_line(err, file=exp_path, key="(file)", expect="expected a readable YAML file")


@pytest.mark.parametrize("extra, key, expect", [
    (["--tolerance", "rejection_point"], "--tolerance", "expected NAME=NUMBER"),
    (["--tolerance", "rejection_point=lots"], "--tolerance", "expected NAME=NUMBER"),
    (["--tolerance", "rejection=1"], "--tolerance: rejection", "(did you mean 'rejection_point'?)"),
    (["--tolerance", "usage_gap=7"], "--tolerance: usage_gap", "in [0, 1], got 7"),
    (["--tolerance", "reported_capacity=1.5"], "--tolerance: reported_capacity", "a relative tolerance in [0, 1)"),
    (["--name", "nobody"], "name", "no expectation named 'nobody'"),
    (["--profile", "no-such-profile"], "profile", "no-such-profile"),
    (["--budget", "-5"], "--budget", "a time budget in seconds > 0"),
])
def test_console_probe_with_a_bad_option_exits_2_with_one_line(tmp_path, capsys, extra, key, expect):
    _, _, exp_path = write_case(tmp_path, Case("none", "", ""))
    code = cli.main(["probe", str(exp_path), "--artifacts", str(tmp_path / "art"), *extra])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kvprobe probe: error: ") and key in lines[0] and expect in lines[0], lines[0]


@pytest.mark.parametrize("case_id", SUBPROCESS_IDS)
def test_real_console_subprocess_exit_code_and_single_stderr_line(tmp_path, case_id):
    case = next(c for c in CASES if c.id == case_id)
    _, profile_path, exp_path = write_case(tmp_path, case)
    proc = subprocess.run([sys.executable, "-m", "kvprobe", "probe", str(exp_path), "--artifacts",
                           str(tmp_path / "art")], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc
    assert proc.stdout == ""
    assert_one_clear_line(proc.stderr, file=expected_file(case, exp_path, profile_path), key=case.key,
                          expect=case.expect)


@pytest.mark.parametrize("argv, words", [
    (["ledger", "--engine", "tgi", "--model", "meta-llama/Llama-3.1-8B"], "invalid choice: 'tgi'"),
    (["ledger", "--engine", "vllm"], "the following arguments are required: --model"),
    (["ledger", "--engine", "vllm", "--model", "meta-llama/Llama-3.1-8B", "--no-such-flag"], "unrecognized arguments"),
    (["ledger", "--engine", "vllm", "--model", "meta-llama/Llama-3.1-8B", "--gpu-memory", "lots"], "--gpu-memory"),
    (["ledger", "--engine", "vllm", "--model", "meta-llama/Llama-3.1-8X", "--gpu-memory", "24GiB"], "preset"),
    (["ledger", "--engine", "vllm", "--model", "meta-llama/Llama-3.1-8B", "--gpu-memory", "24GiB",
      "--max-num-seqs", "many"], "--max-num-seqs"),
])
def test_ledger_bad_flags_exit_2(capsys, argv, words):
    assert console_exit_code(argv) == 2
    _, err = capsys.readouterr()
    assert words in err, err
    assert "Traceback" not in err


def test_real_console_ledger_bad_flag_subprocess():
    proc = subprocess.run([sys.executable, "-m", "kvprobe", "ledger", "--engine", "vllm", "--model",
                           "meta-llama/Llama-3.1-8B", "--gpu-memory", "24 bananas"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    assert len(proc.stderr.splitlines()) == 1 and "--gpu-memory" in proc.stderr, proc.stderr


def console_exit_code(argv: list[str]) -> int:
    """`kvprobe.cli.main.main`'s code, whether it returns it or argparse exits with it."""
    try:
        return cli.main(argv)
    except SystemExit as exit_:
        return exit_.code
