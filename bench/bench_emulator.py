"""How many concurrently running streamed requests one emulator process holds with step lag < 5%.

The emulator runs as `python -m kvprobe emulate vllm` (its own process group) with the default time
model; a separate client process holds N streams open with raw asyncio sockets (reads and discards,
so the client is cheap). Per level: wait until /metrics shows N running, then over a hold window
step lag = (Δkvprobe_emulator_lag_seconds_total + Δkvprobe_emulator_step_lag_seconds) /
Δkvprobe_emulator_model_seconds_total: real time run past the modelled time, as a fraction of it. Every level is
bounded in count and time; every process is stopped at the end.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

LEVELS = (250, 500, 1000, 2000, 3000, 4000)
HOLD_S = 3.0
LAG_LIMIT = 0.05
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "kvprobe_emulator_lag_seconds_total",
                 "kvprobe_emulator_model_seconds_total", "kvprobe_emulator_steps_total",
                 "kvprobe_emulator_step_lag_seconds"):
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def _client(port: int, n: int, stop, deadline_s: float) -> None:
    async def one(i: int):
        body = json.dumps({"prompt": [1 + i % 30000] * 16, "max_tokens": 3000, "min_tokens": 3000,
                           "ignore_eos": True, "stream": True}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            while await reader.read(1 << 16):
                pass
        finally:
            writer.close()

    async def main():
        tasks = []
        for i in range(n):
            tasks.append(asyncio.ensure_future(one(i)))
            if i % 50 == 49:
                await asyncio.sleep(0.01)
        end = time.monotonic() + deadline_s
        while not stop.is_set() and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def _wait(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return False


def run_level(port: int, n: int) -> dict:
    stop = mp.Event()
    client = mp.Process(target=_client, args=(port, n, stop, 30.0), daemon=True)
    client.start()
    try:
        reached = _wait(lambda: _scrape(port)["vllm:num_requests_running"] >= n, 20.0)
        a = _scrape(port)
        t0 = time.monotonic()
        time.sleep(HOLD_S)
        b = _scrape(port)
        dt = time.monotonic() - t0
    finally:
        stop.set()
        client.join(10)
        if client.is_alive():
            client.kill()
    _wait(lambda: _scrape(port)["vllm:num_requests_running"] == 0, 10.0)
    model = b["kvprobe_emulator_model_seconds_total"] - a["kvprobe_emulator_model_seconds_total"]
    lag = (b["kvprobe_emulator_lag_seconds_total"] - a["kvprobe_emulator_lag_seconds_total"]
           + b["kvprobe_emulator_step_lag_seconds"] - a["kvprobe_emulator_step_lag_seconds"])
    steps = b["kvprobe_emulator_steps_total"] - a["kvprobe_emulator_steps_total"]
    return {"streams": n, "reached": reached, "running": b["vllm:num_requests_running"],
            "lag": lag / model if model else float("inf"), "steps_per_s": steps / dt,
            "model_step_ms": 1e3 * model / steps if steps else 0.0}


TIME_MODELS = {  # name -> emulator time-model flags
    "default (5 ms + 1 us/prefill token + 20 us/decode seq)": [],
    "fixed 10 ms step (no per-sequence cost: the harder case)": ["--step-ms", "10", "--decode-us-per-seq", "0"],
}


def sweep(time_flags: list[str]) -> list[dict]:
    port = _free_port()
    blocks = max(LEVELS) * ((16 + 3000) // 16 + 2) + 16
    argv = [sys.executable, "-m", "kvprobe", "emulate", "vllm", "--port", str(port), "--num-gpu-blocks-override",
            str(blocks), "--max-model-len", "4096", "--max-num-seqs", str(max(LEVELS) * 2),
            "--max-num-batched-tokens", str(max(LEVELS) * 32), *time_flags]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                              start_new_session=True)
    rows = []
    try:
        if not _wait(lambda: _health(port), 20.0):
            raise RuntimeError("emulator did not become healthy")
        for n in LEVELS:
            row = run_level(port, n)
            rows.append(row)
            if row["lag"] > 4 * LAG_LIMIT or not row["reached"]:
                break
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(5)
    return rows


def main() -> None:
    for title, flags in TIME_MODELS.items():
        rows = sweep(flags)
        print(f"emulator, vLLM dialect, one process; time model: {title}")
        print(f"{'streams':>8} {'running':>8} {'model step':>11} {'steps/s':>8} {'step lag':>9}")
        for r in rows:
            print(f"{r['streams']:>8} {r['running']:>8.0f} {r['model_step_ms']:>9.1f}ms {r['steps_per_s']:>8.1f} "
                  f"{100 * r['lag']:>8.1f}%")
        ok = [r["streams"] for r in rows if r["reached"] and r["lag"] < LAG_LIMIT]
        print(f"max concurrent running streams with step lag < {100 * LAG_LIMIT:.0f}%: {max(ok) if ok else 0}\n")


def _health(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
    except OSError:
        return False


if __name__ == "__main__":
    main()
