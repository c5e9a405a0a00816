"""The console face: `kvprobe ledger | emulate | probe`.

Each subcommand lives in its own module exposing `add_parser(subparsers)`, which registers its
arguments and sets `func(args) -> int`. Imports are lazy so `kvprobe ledger` never loads aiohttp
or Locust.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvprobe.errors import KvprobeError

SUBCOMMANDS = {
    "ledger": "kvprobe.cmd_ledger",
    "emulate": "kvprobe.emulator.cli",
    "probe": "kvprobe.cmd_probe",
    "shadow": "kvprobe.shadow.cli",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvprobe",
        description="Predict how many concurrent requests vLLM or SGLang admits, and check it against the engine.")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    sub.required = True
    # Only import the module of the subcommand being run (and all of them for --help).
    wanted = [a for a in argv if a in SUBCOMMANDS][:1] or list(SUBCOMMANDS)
    for name in wanted:
        importlib.import_module(SUBCOMMANDS[name]).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KvprobeError as err:
        print(f"kvprobe {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"kvprobe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
