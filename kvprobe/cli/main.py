"""The console face: `kvprobe ledger | emulate | probe | diff | profiles | shadow | worker`.

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
    "ledger": "kvprobe.cli.ledger",
    "emulate": "kvprobe.cli.emulate",
    "probe": "kvprobe.cli.probe",
    "diff": "kvprobe.cli.diff",
    "profiles": "kvprobe.cli.profiles",
    "shadow": "kvprobe.cli.shadow",
    "worker": "kvprobe.load.worker",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    from kvprobe.cli.common import Parser

    parser = Parser(
        prog="kvprobe",
        description="Predict how many concurrent requests vLLM or SGLang admits, and check it against the engine.")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    sub.required = True
    # Only import the module of the subcommand being run (and all of them for --help).
    wanted = [a for a in argv if a in SUBCOMMANDS][:1] or list(SUBCOMMANDS)
    for name in wanted:
        importlib.import_module(SUBCOMMANDS[name]).add_parser(sub)
    return parser


def _unknown_options(parser: argparse.ArgumentParser, args, extra: list[str]) -> None:
    """argparse's own "unrecognized arguments" error, with the closest option of the subcommand."""
    from kvprobe.spec.node import did_you_mean

    sub = parser._subparsers._group_actions[0].choices.get(args.command) if parser._subparsers else None
    options = list(sub._option_string_actions) if sub is not None else []
    hint = next((did_you_mean(a.split("=", 1)[0], options) for a in extra if a.startswith("--")), "")
    (sub or parser).error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    # A subcommand that fronts an engine (`kvprobe shadow vllm MODEL [vllm serve flags]`) passes the
    # flags it does not know to that engine; every other subcommand refuses them.
    if extra and not getattr(args, "passthrough", False):
        _unknown_options(parser, args, extra)
    args.extra = extra
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
