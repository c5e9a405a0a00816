"""The measured plateau against the engine's own running mean deep in saturation (issue 11).

For each expectation — the shipped emulated ones by default; a shadow (real-engine) expectation is
one `--expectations PATH` away — the probe runs `--runs` times (default 5) with the expectation's
own profile and only the `rejection_point` check, and the engine's true saturated running mean is
measured once, independently: one long level at `--deep-factor` × the predicted limit, the
running count averaged over its steady part. The count is the engine's own:

- the emulator's `kvprobe_emulator_running` (its scheduler's count after every step) when the
  target is the emulator, the engine's running gauge otherwise;
- averaged where the engine's gauge is a count after every step (vLLM: what its dashboard
  averages); its full-batch reading where the gauge is a sample (SGLang publishes the count
  before a prefill's admissions, and the full batch every 40 decode steps; deep in saturation
  every decode batch is full, and a finished request's slot is refilled at the next step, so the
  per-step average sits one step per request lifetime below the batch the engine holds).

The probe runs with the `rejection_point` tolerance set to ±`--target`, so its ramp adds deep
levels until the plateau's uncertainty fits the tolerance (as it does for any tolerance).

Reported per run: the measured plateau ± its uncertainty, the reference, the difference, whether it
is within ±`--target` (0.5 requests), the check's status and the wall time; then per engine how
many runs were within the target. Run: `python -m bench.bench_plateau [--runs 5] [--hold S]
[--expectations a.yaml,b.yaml]` (about 12 minutes for the two emulated expectations).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvprobe.engines import get_dialect
from kvprobe.engines.base import MetricMap
from kvprobe.probe.run import ProbeOptions, open_target, predict, run_probe
from kvprobe.spec.expectation import load_expectations
from kvprobe.tables import render_table

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ("expectations/emulated-vllm.yaml", "expectations/emulated-sglang.yaml")
WARMUP = 0.25  # of the deep level, discarded


def reference(exp, *, factor: float, seconds: float, workdir: Path) -> dict:
    """The engine's own running count, averaged over one long deep level."""
    from kvprobe.load.runner import LocustRun
    from kvprobe.observe.sampler import Sampler
    from kvprobe.targets.emulator.metrics import TRUE_RUNNING

    dialect = get_dialect(exp.engine)
    emulated = exp.target.mode == "emulator"
    running = TRUE_RUNNING if emulated else dialect.METRICS.running
    metrics = MetricMap(running=running, waiting=dialect.METRICS.waiting, usage=dialect.METRICS.usage)
    users = math.ceil(factor * float(predict(exp).admission.limit))
    shape = exp.profile.request
    target = open_target(exp, ProbeOptions(artifacts_dir=workdir), workdir)
    try:
        sampler = Sampler(target.url, metrics, interval=0.1, headers=target.headers).start()
        load = LocustRun(target.url, model=exp.served_model_name or exp.model, prompt_tokens=shape.prompt_tokens,
                         output_tokens=shape.output_tokens, workdir=workdir / "locust", engine=exp.engine,
                         processes=exp.profile.processes, time_limit=seconds + 60,
                         api_key_env=exp.target.api_key_env)
        with load:
            load.start()
            t0 = time.time()
            load.set_users(users)
            t_start = load.wait_level(users, since=t0, timeout=60)
            hold(target, load, until=t_start + seconds)
            t_end = time.time()
        series = sampler.stop()
    finally:
        target.stop()
    a = series.arrays()
    sel = (a["t"] >= t_start + WARMUP * (t_end - t_start)) & (a["t"] <= t_end) & np.isfinite(a["running"])
    values = a["running"][sel]
    exact = dialect.RUNNING_GAUGE_EXACT
    value = float(values.mean()) if exact else float(values.max())
    return {"users": users, "value": value, "samples": int(values.size),
            "source": running + (" (mean)" if exact else " (full batch)"),
            "waiting": float(np.nanmean(a["waiting"][sel]))}


def hold(target, load, *, until: float) -> None:
    """Hold the level (the sampler watches it), failing fast when the engine or Locust dies."""
    while (left := until - time.time()) > 0:
        if not target.alive() or not load.alive():
            raise RuntimeError(f"the {'engine' if not target.alive() else 'Locust run'} died during the deep level")
        time.sleep(min(0.2, left))


def one_run(exp, workdir: Path) -> dict:
    start = time.monotonic()
    result = run_probe(exp, ProbeOptions(artifacts_dir=workdir))
    check = result.check("rejection_point")
    return {"wall": time.monotonic() - start, "status": result.status, "error": result.error,
            "measured": check.measured if check else None, "uncertainty": check.uncertainty if check else None,
            "levels": len(result.levels), "deep": list(result.rejection.deep_levels) if result.rejection else []}


def prepare(path: str, hold: float | None, tolerance: float):
    exp = load_expectations(ROOT / path if not Path(path).is_absolute() else Path(path))[0]
    profile = exp.profile
    if hold is not None:
        profile = replace(profile, hold=replace(profile.hold, seconds=hold, lifetimes=None))
    budget = max(profile.budget_seconds, 400.0)  # room for the deep levels a tight tolerance asks for
    return replace(exp, profile=replace(profile, drain_seconds=3.0, budget_seconds=budget), checks=("rejection_point",),
                   tolerances=replace(exp.tolerances, rejection_point=tolerance, rejection_point_relative=0.0))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--expectations", default=",".join(DEFAULT), help="comma-separated expectation files")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--hold", type=float, default=5.0, help="seconds per level (0: the profile's)")
    ap.add_argument("--deep-factor", type=float, default=2.0, help="the reference level, x the predicted limit")
    ap.add_argument("--deep-seconds", type=float, default=60.0)
    ap.add_argument("--target", type=float, default=0.5, help="requests: |measured - reference| to meet")
    args = ap.parse_args(argv or [])
    rows, summary = [], []
    with tempfile.TemporaryDirectory(prefix="kvprobe-bench-plateau-") as tmp:
        for path in args.expectations.split(","):
            exp = prepare(path, args.hold or None, args.target)
            ref = reference(exp, factor=args.deep_factor, seconds=args.deep_seconds, workdir=Path(tmp) / exp.name)
            print(f"   {exp.name}: reference {ref['value']:.2f} running at N={ref['users']} "
                  f"({ref['source']}, {ref['samples']} samples, {ref['waiting']:.1f} waiting)", flush=True)
            within = []
            for i in range(args.runs):
                run = one_run(exp, Path(tmp) / f"{exp.name}-{i}")
                m, u = run["measured"], run["uncertainty"]
                diff = None if m is None else m - ref["value"]
                ok = diff is not None and abs(diff) <= args.target
                within.append(ok)
                row = [exp.name, i + 1, "—" if m is None else f"{m:.2f} ± {u or 0:.2f}", f"{ref['value']:.2f}",
                       "—" if diff is None else f"{diff:+.2f}", "yes" if ok else "NO", run["status"],
                       f"{run['levels']} ({len(run['deep'])} deep)", f"{run['wall']:.0f}", run["error"] or ""]
                rows.append(row)
                print("   " + " | ".join(map(str, row)), flush=True)
            summary.append(f"{exp.name} ({exp.engine}): {sum(within)}/{len(within)} runs within "
                           f"±{args.target:g} of {ref['value']:.2f}")
    print(render_table(["expectation", "run", "measured plateau", "reference", "diff", f"±{args.target:g}", "status",
                        "levels", "wall s", "error"], rows,
                       title="measured plateau vs the engine's own deep-saturation running mean"))
    for line in summary:
        print("   " + line)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
