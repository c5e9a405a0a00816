"""Which target for which size: engine steps per second, and the largest running count kept in real
time, of the vLLM shadow (vLLM 0.33.0's own serving stack, sync and async scheduling) beside the
emulator, on one workload and one time model.

Workload: N streams of a 16-token prompt and 3000 output tokens (ignore_eos), held open by a cheap
raw-socket client process (bench_emulator's), so every running request decodes at every step.
Steps per second = Δ vllm:generation_tokens / Δt / N (each step yields one token per running
request). Real time = modelled step (the time model at N decodes) x steps per second: 1.0 means
the target runs as fast as the model says; below it, the target's own code is slower than the GPU
step it stands for, and request lifetimes stretch. Installs the engine environment when it is
missing (`kvprobe shadow install vllm==0.33.0`); every server is stopped at the end of its sweep.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_emulator import _client, _scrape, _wait
from kvprobe.engines import vllm as dialect
from kvprobe.procgroup import free_port
from kvprobe.targets.launch import Target
from kvprobe.targets.shadow import launch
from kvprobe.theory.model.geometry import load_model_config
from kvprobe.theory.sim.steptime import TimeModel

LEVELS = (16, 32, 64, 128, 256)
HOLD_S = 5.0
REAL_TIME = 0.95  # "sustained in real time": at least this share of the modelled step rate
TIME_MODEL = TimeModel(step_ms=10.0, prefill_us_per_token=2.0, decode_us_per_seq=2.0)
MODEL = "meta-llama/Llama-3.1-8B"
FLAGS = {"num-gpu-blocks-override": 50_000, "block-size": 16, "max-model-len": 4096, "max-num-seqs": 512,
         "max-num-batched-tokens": 8192, "enable-prefix-caching": False}


def _generated(port: int) -> float:
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def run_level(port: int, n: int) -> dict:
    stop = mp.Event()
    client = mp.Process(target=_client, args=(port, n, stop, 60.0), daemon=True)
    client.start()
    try:
        reached = _wait(lambda: _scrape(port)["vllm:num_requests_running"] >= n, 40.0)
        g0, t0 = _generated(port), time.monotonic()
        time.sleep(HOLD_S)
        g1, dt = _generated(port), time.monotonic() - t0
        running = _scrape(port)["vllm:num_requests_running"]
    finally:
        stop.set()
        client.join(10)
        if client.is_alive():
            client.kill()
    _wait(lambda: _scrape(port)["vllm:num_requests_running"] == 0, 30.0)
    steps_per_s = (g1 - g0) / dt / max(running, 1)
    model_step = TIME_MODEL.step_seconds(0, n)
    return {"streams": n, "reached": reached, "running": running, "steps_per_s": steps_per_s,
            "real_time": steps_per_s * model_step, "model_step_ms": 1e3 * model_step}


def _argv(target: str, port: int) -> tuple[list[str], dict]:
    if target == "emulator":
        tm = ["--step-ms", str(TIME_MODEL.step_ms), "--prefill-us-per-token", str(TIME_MODEL.prefill_us_per_token),
              "--decode-us-per-seq", str(TIME_MODEL.decode_us_per_seq)]
        return dialect.emulator_command(MODEL, FLAGS, host="127.0.0.1", port=port, extra=tm), {}
    config, _ = load_model_config(MODEL)
    flags = {**FLAGS, "async-scheduling": target == "shadow-async"}
    return launch.command(launch.ShadowLaunch(engine="vllm", version="0.33.0", model=MODEL, config=config,
                                              served_model_name=MODEL, flags=flags, port=port,
                                              time_model=TIME_MODEL))


def sweep(target: str, logdir: Path) -> list[dict]:
    port = free_port()
    argv, env = _argv(target, port)
    rows: list[dict] = []
    with Target.launch(argv, engine="vllm", port=port, log_path=str(logdir / f"{target}.log"),
                       startup_timeout=300, env=env):
        for n in LEVELS:
            row = run_level(port, n)
            rows.append(row)
            if not row["reached"] or row["real_time"] < 0.8:
                break
    return rows


def main() -> None:
    from kvprobe.targets.shadow import envs

    envs.ensure("vllm", "0.33.0", log=print)  # installs the engine environment when it is missing
    print(f"vLLM dialect, {MODEL}; N streams of P=16, O=3000; time model {TIME_MODEL.encode()}")
    summary = []
    with tempfile.TemporaryDirectory(prefix="kvprobe-bench-shadow-") as tmp:
        for target in ("emulator", "shadow-sync", "shadow-async"):
            t0 = time.monotonic()
            rows = sweep(target, Path(tmp))
            print(f"\n{target} ({time.monotonic() - t0:.0f} s)")
            print(f"{'streams':>8} {'running':>8} {'model step':>11} {'steps/s':>8} {'real time':>10}")
            for r in rows:
                print(f"{r['streams']:>8} {r['running']:>8.0f} {r['model_step_ms']:>9.2f}ms {r['steps_per_s']:>8.1f} "
                      f"{100 * r['real_time']:>9.0f}%")
            ok = [r["streams"] for r in rows if r["reached"] and r["real_time"] >= REAL_TIME]
            summary.append((target, rows[0]["steps_per_s"] if rows else 0.0, max(ok) if ok else 0))
    print(f"\n{'target':<14} {'steps/s at ' + str(LEVELS[0]):>16} {'max running in real time':>26}")
    for target, sps, best in summary:
        print(f"{target:<14} {sps:>16.1f} {best:>26}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
