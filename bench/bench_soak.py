"""Soak: the emulator and a probe at the largest load this machine sustains, for several minutes.

The vLLM emulator gets a pool of 3001 blocks (admission limit ~300 for P=128, O=32); the probe
attaches to it and holds a few hundred closed-loop users with Locust in `processes=2`, 127.0.0.1
only, bounded by the profile's time budget. Reported: requests served, errors, the emulator's step
lag from its own /metrics (kvprobe_emulator_*: real time run past the time model, as a fraction of
it), client health, and the blocks in use after the drain (must be zero).

Run: `python -m bench.bench_soak [--seconds 180] [--levels 150,300,400]`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvprobe.engines import get_dialect
from kvprobe.load.records import ABORTED
from kvprobe.observe.http import http_get
from kvprobe.probe.run import ProbeOptions, run_probe
from kvprobe.procgroup import free_port
from kvprobe.spec.expectation import load_expectations
from kvprobe.spec.profile import load_profile
from kvprobe.tables import render_table
from kvprobe.targets.launch import Target

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = 3001


def scrape(url: str) -> dict[str, float]:
    """The emulator's own counters and gauges, summed over labels (`_total` names as exposed)."""
    _, body = http_get(url + "/metrics", timeout=5)
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            if s.name.startswith(("kvprobe_emulator_", "vllm:num_requests", "vllm:kv_cache_usage")):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def step_lag(before: dict, after: dict) -> float:
    """(Δ lag_seconds_total + Δ step_lag_seconds) / Δ model_seconds_total — see emulator/runtime.py."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    model = d.get("kvprobe_emulator_model_seconds_total", 0.0)
    lost = d.get("kvprobe_emulator_lag_seconds_total", 0.0) + d.get("kvprobe_emulator_step_lag_seconds", 0.0)
    return lost / model if model else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=180.0, help="total hold over all levels")
    ap.add_argument("--levels", default="150,300,400", help="closed-loop users per level")
    args = ap.parse_args(argv or [])
    levels = [int(x) for x in args.levels.split(",")]
    hold = args.seconds / len(levels)
    exp = load_expectations(ROOT / "expectations" / "emulated-vllm.yaml")[0]
    flags = {**exp.flags, "num-gpu-blocks-override": BLOCKS, "max-num-seqs": 512, "max-num-batched-tokens": 8192}
    with tempfile.TemporaryDirectory(prefix="kvprobe-bench-soak-") as tmp:
        tmp = Path(tmp)
        profile_path = tmp / "soak.yaml"
        profile_path.write_text(yaml.safe_dump({
            "name": "soak", "request": {"prompt_tokens": 128, "output_tokens": 32, "stream": True},
            "ramp": {"strategy": "explicit", "levels": levels}, "hold": {"seconds": hold, "warmup": 0.2},
            "sampling": {"interval": 0.1}, "budget_seconds": args.seconds + 120, "drain_seconds": 15,
            "processes": 2}))
        exp = replace(exp, flags=flags, profile=load_profile(profile_path),
                      checks=("rejection_point", "leak", "exactness"))
        port = free_port()
        argv_ = get_dialect("vllm").emulator_command(exp.model, flags, host="127.0.0.1", port=port)
        with Target.launch(argv_, engine="vllm", port=port, log_path=str(tmp / "engine.log"),
                           startup_timeout=60) as target:
            before = scrape(target.url)
            start = time.monotonic()
            result = run_probe(exp, ProbeOptions(artifacts_dir=tmp / "art", url=target.url,
                                                 log=lambda line: print("   " + line, flush=True)))
            wall = time.monotonic() - start
            after = scrape(target.url)
        records = [json.loads(x) for x in (tmp / "art" / "requests.jsonl").read_text().splitlines()]
    # requests only (the file also holds Locust's lag and level records); streams cut when the
    # load stops are "aborted" by design, not errors
    records = [r for r in records if r.get("kind", "request") == "request" and r["status"] != ABORTED]
    served = sum(r["status"] == 200 and not r.get("error") for r in records)
    errors = len(records) - served
    kinds: dict[str, int] = {}
    for r in records:
        if r["status"] != 200 or r.get("error"):
            kind = f"{r['status']} {str(r.get('error') or '')[:40]}"
            kinds[kind] = kinds.get(kind, 0) + 1
    usage_after = after.get("kvprobe_emulator_pool_usage", float("nan"))
    blocks_after = round(usage_after * (BLOCKS - 1))
    client = result.client
    rows = [
        ["wall time to verdict", f"{wall:.0f} s"],
        ["levels (users)", ", ".join(str(lv.users) for lv in result.levels)],
        ["requests served", served],
        ["errors", errors],
        ["errors by kind",
         "; ".join(f"{k}: {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:3]) or "none"],
        ["requests/s", f"{served / wall:.0f}"],
        ["emulator step lag (fraction of model time)", f"{step_lag(before, after):.3f}"],
        ["emulator steps",
         f"{after.get('kvprobe_emulator_steps_total', 0) - before.get('kvprobe_emulator_steps_total', 0):.0f}"],
        ["client loop lag p99 / worst",
         f"{getattr(client, 'lag_p99_ms', None)} / {getattr(client, 'lag_worst_ms', None)} ms"],
        ["client saturated", getattr(client, "reason", "?")],
        ["measured plateau vs predicted", f"{getattr(result.check('rejection_point'), 'measured', None)} vs "
                                          f"{getattr(result.check('rejection_point'), 'predicted', None)}"],
        ["blocks in use after drain (must be 0)", blocks_after],
        ["running / waiting after drain", f"{after.get('vllm:num_requests_running', '?')} / "
                                          f"{after.get('vllm:num_requests_waiting', '?')}"],
        ["verdict", result.status.upper() + ("" if result.passed else f" {result.status_reason}")],
    ]
    print(render_table(["soak", "value"], rows, title=f"soak: vLLM emulator, {BLOCKS} blocks, processes=2"))
    if blocks_after != 0:
        raise RuntimeError(f"{blocks_after} blocks still in use after the drain")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
