"""Time to verdict of each ramp strategy against a plain 10-level sweep, at the same accuracy.

Every strategy runs the shipped emulated expectation (vLLM and SGLang dialects) with the same hold,
warm-up, sampling and tolerance — only the choice of levels differs: `around-prediction` (profile
`short`), `bisect` (profile `bisect`) and the fixed 10-level `sweep`. Reported per run: wall time
from start to verdict, levels run, measured rejection point against the prediction, pass/fail.

Run: `python -m bench.bench_ramps [--hold 2] [--engines vllm,sglang]` (about 3 minutes by default).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from kvprobe.probe.run import ProbeOptions, run_probe
from kvprobe.spec.expectation import load_expectations
from kvprobe.spec.profile import load_profile
from kvprobe.tables import render_table

ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = (("around-prediction", "short"), ("bisect", "bisect"), ("sweep (10 levels)", "sweep"))


def one(engine: str, profile_name: str, hold: float, workdir: Path) -> list:
    exp = load_expectations(ROOT / "expectations" / f"emulated-{engine}.yaml")[0]
    profile = load_profile(profile_name)  # shipped with the package
    profile = replace(profile, hold=replace(profile.hold, seconds=hold), drain_seconds=3.0)
    exp = replace(exp, profile=profile, checks=("rejection_point",))
    start = time.monotonic()
    result = run_probe(exp, ProbeOptions(artifacts_dir=workdir / f"{engine}-{profile_name}"))
    wall = time.monotonic() - start
    rp = result.check("rejection_point")
    measured = rp.measured if rp else None
    predicted = rp.predicted if rp else None
    error = abs(measured - predicted) if measured is not None and predicted is not None else None
    return [engine, profile_name, f"{wall:.1f}", len(result.levels),
            "—" if measured is None else f"{measured:.2f}", "—" if predicted is None else f"{predicted:.2f}",
            "—" if error is None else f"{error:.2f}",
            result.status.upper() + ("" if result.passed else f" {result.status_reason}")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold", type=float, default=2.0, help="seconds per level, the same for every strategy")
    ap.add_argument("--engines", default="vllm,sglang")
    args = ap.parse_args(argv or [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvprobe-bench-ramps-") as tmp:
        for engine in args.engines.split(","):
            for label, profile_name in STRATEGIES:
                row = one(engine, profile_name, args.hold, Path(tmp))
                row[1] = label
                rows.append(row)
                print("   " + " | ".join(map(str, row)), flush=True)
    print(render_table(["engine", "strategy", "wall s", "levels", "measured", "predicted", "|error|", "verdict"],
                       rows, title=f"time to verdict per ramp strategy (hold {args.hold:g} s per level)"))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
