"""`kvprobe probe EXPECTATION.yaml [--url URL] [--artifacts DIR]` — one probe from the console.

Exit codes: 0 every probe passed; 1 a check failed (the engine disagrees with the expectation);
2 bad input (one line naming the file and key); 3 a probe could not measure (engine unreachable
or dead, client saturated, no metrics, too few deep levels) and none failed; 130 interrupted.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from kvprobe.errors import ConfigError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "probe", help="run the probe(s) of an expectation file and judge them",
        epilog="exit codes: 0 passed, 1 a check failed, 2 bad input, 3 could not measure, 130 interrupted")
    p.add_argument("expectation", help="an expectations/*.yaml file")
    p.add_argument("--url", help="attach to this running engine instead of launching one")
    p.add_argument("--artifacts", default="artifacts", help="directory for results, records, metrics and the plot")
    p.add_argument("--name", help="run only the expectation with this name")
    p.add_argument("--profile", help="a load profile name or path replacing the expectation's")
    p.add_argument("--budget", type=float, help="time budget per probe in seconds")
    p.add_argument("--tolerance", action="append", default=[], metavar="NAME=VALUE",
                   help="override one tolerance, e.g. rejection_point=2 (repeatable)")
    p.add_argument("--engine-command", help="the engine command to launch instead of the dialect's default (split on spaces)")
    p.set_defaults(func=run)


def parse_tolerances(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"expected NAME=NUMBER, got {item!r}", key="--tolerance") from None
    # The same names and ranges as `tolerances:` in a file: an unknown name or 1.5 for a relative
    # tolerance is a one-line error, not a TypeError from dataclasses.replace deep in the probe.
    from kvprobe.spec import _parse_tolerances
    from kvprobe.spec_schema import Node

    _parse_tolerances(Node(out, "--tolerance"))
    return out


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(args) -> int:
    # SIGTERM takes the same path as Ctrl-C: the probe's finally stops everything it started.
    # The previous handler comes back afterwards (an in-process caller keeps its own).
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args) -> int:
    from kvprobe.errors import KvprobeError
    from kvprobe.probe import ProbeOptions, predict, run_probe
    from kvprobe.report import SUMMARY_HEADERS, closing_line, levels_table, summary_row, verdict_table
    from kvprobe.spec import load_expectations
    from kvprobe.tables import render_table

    if args.budget is not None and not args.budget > 0:
        raise ConfigError(f"expected a time budget in seconds > 0, got {args.budget:g}", key="--budget")
    tolerances = parse_tolerances(args.tolerance)
    expectations = load_expectations(args.expectation)
    if args.name:
        expectations = [e for e in expectations if e.name == args.name]
        if not expectations:
            raise ConfigError(f"no expectation named {args.name!r}", file=args.expectation, key="name")
    root = Path(args.artifacts)
    results = []
    for exp in expectations:
        options = ProbeOptions(
            artifacts_dir=root / exp.name if len(expectations) > 1 else root,
            url=args.url,
            engine_command=args.engine_command.split() if args.engine_command else None,
            tolerances=tolerances,
            budget_seconds=args.budget,
            profile=args.profile,
            log=lambda line: print(line, flush=True),
        )
        try:
            print(predict(exp).render() + "\n", flush=True)  # the theory first: a person reads it while the ramp runs
        except KvprobeError:
            pass  # run_probe reports the same error as the probe's verdict
        result = run_probe(exp, options)
        if result.levels:
            print(levels_table(result))
        print(verdict_table(result))
        print(closing_line(result, options.artifacts_dir))
        results.append(result)
    if len(results) > 1:
        print(render_table(SUMMARY_HEADERS, [summary_row(r) for r in results], title="kvprobe summary"))
    sys.stdout.flush()
    return exit_code([r.status for r in results])


EXIT_CODES = {"passed": 0, "failed": 1, "error": 3}


def exit_code(statuses: list[str]) -> int:
    """A failed check wins (the engine disagrees, whatever else happened), then a probe that could
    not measure; 0 only when every probe passed."""
    for status in ("failed", "error"):
        if status in statuses:
            return EXIT_CODES[status]
    return EXIT_CODES["passed"] if statuses else EXIT_CODES["error"]
