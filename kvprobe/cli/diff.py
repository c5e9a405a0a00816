"""`kvprobe diff EXPECTATION.yaml --versions A,B[,C...] [--repeat N] [--json] [--artifacts DIR]` — the same
expectation probed on several releases of its engine, and what changed between consecutive ones
(kvprobe.probe.diff).

Exit codes: 0 nothing changed beyond the expectation's tolerances; 1 something did; 2 bad input (an
unknown version, a file with several expectations and no --name); 3 a release could not be measured
(engine dead, client saturated, a missing engine environment) and nothing changed among the rest;
130 interrupted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvprobe.errors import ConfigError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "diff", help="run an expectation's probe on several releases of its engine and say what changed",
        epilog="exit codes: 0 nothing changed, 1 something changed, 2 bad input, 3 could not measure, 130 interrupted")
    p.add_argument("expectation", help="an expectation file (one expectation, or choose one with --name)")
    p.add_argument("--versions", metavar="A,B[,C...]",
                   help="the releases to run it on, in order; changes are read between consecutive ones (default: "
                   "the expectation's `versions:`); `installed`: every release whose shadow environment is built here "
                   "(a `launch: shadow` expectation)")
    p.add_argument("--json", action="store_true",
                   help='print {"versions": [...], "results": {VERSION: {...}}, "changes": [...]} (the probes\' '
                   "progress goes to stderr)")
    p.add_argument("--artifacts", default="artifacts/diff",
                   help="directory for each release's probe artifacts (DIR/VERSION/), diff.json, diff.txt and diff.png")
    p.add_argument("--name", help="the expectation of this name, in a file that holds several")
    p.add_argument("--profile", help="a load profile name or path replacing the expectation's")
    p.add_argument("--budget", type=float, help="time budget per release's probe in seconds")
    p.add_argument("--tolerance", action="append", default=[], metavar="NAME=VALUE",
                   help="override one tolerance, e.g. rejection_point=2 (repeatable): a move within it is no change")
    p.add_argument("--repeat", type=int, metavar="N",
                   help="run each release N times in a row (default: the expectation's `repeat:`, else 1): a change "
                   "must then show between every run "
                   "of one release and every run of the next, and what moves between one release's own runs is "
                   "printed as its noise (a preempting shape can settle differently from run to run)")
    p.add_argument("--install", action="store_true",
                   help="build a missing shadow engine environment (a target `launch: shadow`) instead of refusing")
    p.set_defaults(func=run)


INSTALLED = "installed"


def installed_versions(exp, path: str) -> list[str]:
    """`--versions installed`: the releases of the expectation's engine with a complete shadow environment."""
    from kvprobe.targets.shadow import recipes

    if exp.target.mode != "shadow":
        raise ConfigError(f"expected a `launch: shadow` target for --versions installed (the releases whose shadow "
                          f"environment is built here), got {exp.target.mode!r}", file=path, key="--versions")
    found = recipes.installed(exp.engine)
    if len(found) < 2:
        have = ", ".join(found) or "none"
        raise ConfigError(f"expected two or more installed {exp.engine} shadow environments for --versions installed, "
                          f"found {have}: `kvprobe shadow install {exp.engine}==VERSION` builds one", file=path,
                          key="--versions")
    return found


def run(args) -> int:
    from kvprobe.procgroup import sigterm_as_interrupt

    with sigterm_as_interrupt():  # each probe stops what it started, on SIGTERM too
        return _run(args)


def _run(args) -> int:
    from kvprobe.probe.diff import DiffOptions, parse_versions, run_diff
    from kvprobe.report.diff import plot_diff, render_diff
    from kvprobe.spec.expectation import load_expectations, tolerance_overrides

    if args.budget is not None and not args.budget > 0:
        raise ConfigError(f"expected a time budget in seconds > 0, got {args.budget:g}", key="--budget")
    tolerances = tolerance_overrides(args.tolerance)
    expectations = load_expectations(args.expectation)
    if args.name:
        expectations = [e for e in expectations if e.name == args.name]
        if not expectations:
            raise ConfigError(f"no expectation named {args.name!r}", file=args.expectation, key="name")
    if len(expectations) > 1:
        names = ", ".join(e.name for e in expectations)
        raise ConfigError(f"expected one expectation to run on several releases, the file holds {len(expectations)} "
                          f"({names}): choose one with --name", file=args.expectation)
    exp = expectations[0]
    if args.versions is None and not exp.versions:
        raise ConfigError("expected --versions A,B[,C...], or `versions: [A, B]` in the expectation",
                          file=args.expectation, key="versions")
    if args.versions == INSTALLED:
        versions = installed_versions(exp, args.expectation)
    else:
        versions = parse_versions(args.versions) if args.versions is not None else list(exp.versions)
    out = sys.stderr if args.json else sys.stdout
    root = Path(args.artifacts)
    options = DiffOptions(artifacts_dir=root, install=args.install, tolerances=tolerances,
                          budget_seconds=args.budget, profile=args.profile,
                          repeat=exp.repeat if args.repeat is None else args.repeat,
                          log=lambda line: print(line, file=out, flush=True))
    diff = run_diff(exp, versions, options)
    doc = {"expectation": {"name": exp.name, "path": str(exp.path), "engine": exp.engine}, **diff.to_dict()}
    root.mkdir(parents=True, exist_ok=True)
    (root / "diff.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = render_diff(diff, exp)
    (root / "diff.txt").write_text(text + "\n")
    plot_diff(diff, exp, root / "diff.png")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(text)
    sys.stdout.flush()
    return diff.exit_code
