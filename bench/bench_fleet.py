"""A 4-replica emulated vLLM fleet behind the real sglang-router 0.3.2, probed end to end.

The shipped fleet expectation (expectations/fleet/emulated-vllm-fleet.yaml) with 4 replicas: one
replica admits ~7.8 (80 usable blocks, P=128 O=32), the fleet ~31; the levels straddle 4 x 8.
Reported: the time to verdict (launch of 4 emulators and the router, calibration, every level,
the drain, the checks), the fleet's plateau against R x L, and each replica's share at the deepest
level. The router's environment is installed first when it is missing (about 11 s).

Run: `python -m bench.bench_fleet [--replicas 4] [--policy round_robin]`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from kvprobe.probe.run import ProbeOptions, run_probe
from kvprobe.spec.expectation import load_expectations
from kvprobe.tables import render_table
from kvprobe.targets.fleet import router as rt
from kvprobe.targets.shadow import envs

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "expectations" / "fleet" / "emulated-vllm-fleet.yaml"


def run(replicas: int = 4, policy: str = "round_robin") -> dict:
    envs.ensure(rt.NAME, rt.VERSION, log=lambda line: None)
    exp = load_expectations(FLEET)[0]
    L = 8  # one replica's no-preemption limit here (floor(80 / 10))
    levels = (replicas * L // 2, replicas * L, replicas * L + 2 * replicas, replicas * L + 4 * replicas)
    exp = replace(exp, name=f"fleet-{replicas}x-{policy}",
                  target=replace(exp.target, fleet={**exp.target.fleet, "replicas": replicas, "policy": policy}),
                  profile=replace(exp.profile, ramp=replace(exp.profile.ramp, levels=levels), budget_seconds=120))
    with tempfile.TemporaryDirectory(prefix="kvprobe-bench-fleet-") as tmp:
        t0 = time.monotonic()
        result = run_probe(exp, ProbeOptions(artifacts_dir=Path(tmp) / "art"))
        seconds = time.monotonic() - t0
    rp = result.check("rejection_point")
    deepest = (result.fleet or {}).get("levels", [{}])[-1]
    return {"replicas": replicas, "policy": policy, "status": result.status, "seconds": seconds,
            "predicted": rp.predicted if rp else None, "measured": rp.measured if rp else None,
            "uncertainty": rp.uncertainty if rp else None, "levels": levels,
            "deepest": [(r["running"], r["waiting"]) for r in deepest.get("replicas", [])],
            "failed": [f"{c.name}: {c.reason}" for c in result.checks if not c.passed], "error": result.error}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--policy", default="round_robin", choices=rt.POLICIES)
    args = ap.parse_args(argv or [])
    r = run(args.replicas, args.policy)
    share = "  ".join(f"{run_:.1f}+{wait:.1f}" for run_, wait in r["deepest"])
    print(render_table(["fleet", "status", "time to verdict", "levels", "plateau (fleet)", "predicted plateau",
                        "per replica at deepest (running+waiting)"],
                       [[f"{r['replicas']} x emulated vLLM, {r['policy']}", r["status"], f"{r['seconds']:.1f} s",
                         ",".join(map(str, r["levels"])),
                         f"{r['measured']:.2f} ± {r['uncertainty'] or 0:.2f}" if r["measured"] is not None else "—",
                         f"{r['predicted']:.2f}" if r["predicted"] is not None else "—", share]]))
    if r["failed"] or r["error"]:
        print("   failed checks:\n     " + "\n     ".join(r["failed"]) + f"\n   error: {r['error']}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
