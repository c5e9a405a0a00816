"""The SGLang shadow beside the emulator (the SGLang part of the shadow bench; bench_shadow.py has
vLLM's): engine steps per second, and the largest running count kept in real time, of SGLang 0.5.23's
own serving stack with kvprobe's plugin, with overlap scheduling (SGLang's default) and without, on
the workload and time model of the vLLM shadow's bench.

Workload: N streams of a 16-token prompt and 3000 output tokens (ignore_eos), held open by
bench_emulator's raw-socket client process, so every running request decodes at every step. Steps
per second = the median of SGLang's sglang:gen_throughput gauge (tokens/s over each 40-step window)
over the hold / N; the emulator's from its own step counter. Real time = modelled step (the time model at N
decodes) x steps per second: 1.0 means the target runs as fast as the model says. SGLang allocates
its KV pool for real, so the model is Llama-3.1-8B's config cut to one layer (8 KiB of KV per token
instead of 128): the scheduler's work per step does not depend on the layer count. Needs the engine
environment (`kvprobe shadow install sglang==0.5.23`); every server is stopped at the end of its sweep.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.bench_emulator import _client, _wait
from kvprobe.engines import sglang as dialect
from kvprobe.procgroup import free_port
from kvprobe.targets.launch import Target
from kvprobe.targets.shadow import launch
from kvprobe.theory.model.geometry import load_model_config
from kvprobe.theory.sim.steptime import TimeModel

LEVELS = (16, 32, 64, 128)
HOLD_S = 5.0
REAL_TIME = 0.95  # "sustained in real time": at least this share of the modelled step rate
TIME_MODEL = TimeModel(step_ms=10.0, prefill_us_per_token=2.0, decode_us_per_seq=2.0)
PRESET = "meta-llama/Llama-3.1-8B"
POOL = max(LEVELS) * 3100 + 4096  # tokens: every stream's 3016 at its end, and headroom
FLAGS = {"max-total-tokens": POOL, "context-length": 4096, "max-running-requests": 512,
         "chunked-prefill-size": 8192, "disable-radix-cache": True}


def _families(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _steps_per_s(port: int, n: int) -> float | None:
    """SGLang: its gen_throughput gauge (tokens/s over the last 40 decode steps) / N; the emulator:
    None (its step counter is read instead)."""
    samples = _families(port).get(dialect.METRICS.extra["gen_throughput"])
    return samples[0].value / n if samples else None


def _emulator_steps(port: int) -> float:
    samples = _families(port).get("kvprobe_emulator_steps") or []
    return sum(s.value for s in samples if s.name.endswith("_total"))


def _running(port: int) -> float:
    samples = _families(port).get(dialect.METRICS.running) or []
    return samples[0].value if samples else 0.0


def run_level(port: int, n: int) -> dict:
    stop = mp.Event()
    client = mp.Process(target=_client, args=(port, n, stop, 90.0), daemon=True)
    client.start()
    try:
        # the running gauge is published at prefill batches and every 40 decode steps
        reached = _wait(lambda: _running(port) >= n, 60.0)
        s0, t0, readings = _emulator_steps(port), time.monotonic(), []
        while time.monotonic() - t0 < HOLD_S:
            time.sleep(0.5)
            value = _steps_per_s(port, n)
            if value is not None:
                readings.append(value)
        dt = time.monotonic() - t0
        steps = (_emulator_steps(port) - s0) / dt
    finally:
        stop.set()
        client.join(10)
        if client.is_alive():
            client.kill()
    _wait(lambda: _running(port) == 0, 45.0)
    steps_per_s = sorted(readings)[len(readings) // 2] if readings else steps
    model_step = TIME_MODEL.step_seconds(0, n)
    return {"streams": n, "reached": reached, "steps_per_s": steps_per_s,
            "real_time": steps_per_s * model_step, "model_step_ms": 1e3 * model_step}


def _argv(target: str, port: int) -> tuple[list[str], dict]:
    if target == "emulator":
        tm = ["--step-ms", str(TIME_MODEL.step_ms), "--prefill-us-per-token", str(TIME_MODEL.prefill_us_per_token),
              "--decode-us-per-seq", str(TIME_MODEL.decode_us_per_seq)]
        return dialect.emulator_command(PRESET, FLAGS, host="127.0.0.1", port=port, extra=tm), {}
    config, _ = load_model_config(PRESET)
    one_layer = {**config, "num_hidden_layers": 1}
    flags = {**FLAGS, "disable-overlap-schedule": target == "shadow-no-overlap"}
    return launch.command(launch.ShadowLaunch(
        engine="sglang", version="0.5.23", model="bench/llama-3.1-8b-1-layer", config=one_layer,
        served_model_name="bench", flags=flags, port=port, time_model=TIME_MODEL))


def sweep(target: str, logdir: Path) -> list[dict]:
    port = free_port()
    argv, env = _argv(target, port)
    rows: list[dict] = []
    with Target.launch(argv, engine="sglang", port=port, log_path=str(logdir / f"{target}.log"),
                       startup_timeout=300, env=env):
        for n in LEVELS:
            row = run_level(port, n)
            rows.append(row)
            if not row["reached"] or row["real_time"] < 0.8:
                break
    return rows


def main() -> None:
    print(f"SGLang dialect, {PRESET} (one layer for the shadow's real KV pool); N streams of P=16, O=3000; "
          f"time model {TIME_MODEL.encode()}")
    summary = []
    with tempfile.TemporaryDirectory(prefix="kvprobe-bench-shadow-sglang-") as tmp:
        for target in ("emulator", "shadow", "shadow-no-overlap"):
            t0 = time.monotonic()
            rows = sweep(target, Path(tmp))
            print(f"\n{target} ({time.monotonic() - t0:.0f} s)")
            print(f"{'streams':>8} {'reached':>8} {'model step':>11} {'steps/s':>8} {'real time':>10}")
            for r in rows:
                print(f"{r['streams']:>8} {str(r['reached']):>8} {r['model_step_ms']:>9.2f}ms {r['steps_per_s']:>8.1f} "
                      f"{100 * r['real_time']:>9.0f}%")
            ok = [r["streams"] for r in rows if r["reached"] and r["real_time"] >= REAL_TIME]
            summary.append((target, rows[0]["steps_per_s"] if rows else 0.0, max(ok) if ok else 0))
    print(f"\n{'target':<18} {'steps/s at ' + str(LEVELS[0]):>16} {'max running in real time':>26}")
    for target, sps, best in summary:
        print(f"{target:<18} {sps:>16.1f} {best:>26}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
