"""What the console tests share: `kvprobe ARGS` in-process with its exit code and output, and the
emulators' flags and a bare attach command line."""

from __future__ import annotations

from kvprobe.cli.main import main

# small pools, so the emulators start at once
FLAGS = {"vllm": {"num-gpu-blocks-override": 200, "max-model-len": 1024},
         "sglang": {"max-total-tokens": 4000, "context-length": 1024, "enable-metrics": True}}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """`kvprobe ARGV`: its exit code (argparse's SystemExit included), stdout and stderr."""
    try:
        rc = main(list(argv))
    except SystemExit as exit_:
        rc = exit_.code
    out, err = capsys.readouterr()
    return rc, out, err


def bare(engine: str, url: str) -> list[str]:
    """`kvprobe probe --url` with no expectation file, the smallest request."""
    return ["probe", "--url", url, "--engine", engine, "--prompt-tokens", "8", "--output-tokens", "8"]
