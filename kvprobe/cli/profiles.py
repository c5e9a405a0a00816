"""`kvprobe profiles`: the load profiles shipped with kvprobe, found by name from any folder."""

from __future__ import annotations


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("profiles", help="list the shipped load profiles (use them by name: `profile: short`)")
    p.add_argument("--dir", default=None,
                   help="also list the profiles of this folder (an expectation finds them by name beside it)")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from kvprobe.spec.profile import SHIPPED_PROFILES, load_profile
    from kvprobe.tables import render_table

    folders = [Path(args.dir)] if args.dir else []
    rows = []
    for folder in [*folders, SHIPPED_PROFILES]:
        where = "shipped" if folder == SHIPPED_PROFILES else str(folder)
        for path in sorted(folder.glob("*.y*ml")):
            prof = load_profile(path)
            req, hold = prof.request, prof.hold
            held = f"{hold.seconds:g} s" if hold.seconds is not None else f"{hold.lifetimes:g} lifetimes"
            rows.append([prof.name, where, f"{req.prompt_tokens}+{req.output_tokens}", prof.ramp.strategy, held,
                         f"{prof.budget_seconds:g} s", prof.description or "-"])
    print(render_table(["profile", "from", "P+O", "ramp", "hold/level", "budget", "description"], rows,
                       title="load profiles (an expectation names one: `profile: short`)"))
    print(f"shipped: {SHIPPED_PROFILES}")
    return 0
