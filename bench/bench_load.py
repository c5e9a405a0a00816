"""Load-path capacity: how many concurrent streams the Locust client holds with honest TTFT.

A server on 127.0.0.1 records, per X-Request-Id, when it received the request and when it wrote
the first token. TTFT distortion = client TTFT (first content chunk seen − send) − server TTFT
(first token written − arrival): everything the client and the loopback add. Reported per level of
concurrent streams with the client's own loop-lag p99 and CPU.

Server: tests/load/sse_server.py (aiohttp, per-stream timers). `--emulator` uses
`kvprobe emulate vllm --trace` instead (the emulator's first-token time is its scheduler step).
Run: `python -m bench.bench_load [--levels 100,250,500] [--processes 1,2] [--hold 8] [--emulator]`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvprobe.load.runner import LocustRun, client_health, free_port

ROOT = Path(__file__).resolve().parent.parent
SSE_SERVER = ROOT / "tests" / "load" / "sse_server.py"
PROMPT, OUT = 128, 64
TTFT, ITL = 0.02, 0.05  # the SSE server's own timing: 64 tokens in ~3.2 s per request
LIFETIME = TTFT + ITL * (OUT - 1)


def _wait_url(url: str, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server at {url} not healthy within {timeout:g}s")


class Server:
    def __init__(self, workdir: Path, emulator: bool):
        self.trace = workdir / "server-trace.jsonl"
        self.emulator = emulator
        port = free_port()
        if emulator:
            cmd = [sys.executable, "-m", "kvprobe", "emulate", "vllm", "--port", str(port),
                   "--num-gpu-blocks-override", "100000", "--max-num-seqs", "1024", "--max-model-len", "4096",
                   "--step-ms", str(ITL * 1000), "--trace", str(self.trace)]  # ~ the same ITL as sse_server
        else:
            cmd = [sys.executable, str(SSE_SERVER), "--port", str(port), "--ttft", str(TTFT), "--itl", str(ITL),
                   "--trace", str(self.trace)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.log = open(workdir / "server.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env)
        self.url = f"http://127.0.0.1:{port}"
        _wait_url(self.url + "/health", 30)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        self.log.close()

    def server_ttft(self) -> dict[str, float]:
        out = {}
        for line in self.trace.read_text().splitlines() if self.trace.exists() else []:
            row = json.loads(line)
            rid = row.get("request_id") or row.get("id")
            if rid and row.get("t_first") is not None:
                out[rid] = row["t_first"] - row["t_arrival"]
        return out


def measure(users: int, processes: int, hold: float, emulator: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvp-bench-load-") as tmp:
        tmp = Path(tmp)
        server = Server(tmp, emulator)
        try:
            run = LocustRun(server.url, model="emulated/model" if emulator else "m", prompt_tokens=PROMPT,
                            output_tokens=OUT, workdir=tmp / "locust", processes=processes, time_limit=hold + 60,
                            token_range=100000, start_jitter=LIFETIME)
            with run:
                run.start()
                run.set_users(users)
                t_level = run.wait_level(users, timeout=60)
                # users start spread over one lifetime (closed-loop steady state, not a thundering herd)
                t0 = t_level + LIFETIME + 1.0
                t1 = t0 + hold
                # keep the load on for one more lifetime so requests sent in [t0, t1] finish
                time.sleep(max(0.0, t1 + LIFETIME + 1.0 - time.time()))
                run.stop()
            recs = run.records()
        finally:
            server.stop()
        srv = server.server_ttft()
    reqs = [r for r in recs if r.kind == "request" and r.status == 200 and r.t_send and t0 <= r.t_send <= t1]
    dist = np.array([(r.t_first - r.t_send - srv[r.request_id]) * 1000 for r in reqs if r.request_id in srv])
    health = client_health(recs, t0, t1)
    errors = sum(1 for r in recs if r.kind == "request" and r.status not in (200, "aborted"))
    return {"users": users, "processes": processes, "requests": len(reqs), "matched": len(dist),
            "dist_p50": float(np.percentile(dist, 50)) if len(dist) else float("nan"),
            "dist_p99": float(np.percentile(dist, 99)) if len(dist) else float("nan"),
            "lag_p99": health.lag_p99_ms, "cpu": health.cpu, "cpu_total": health.cpu_total,
            "saturated": health.saturated, "errors": errors}


def sweep(levels: list[int], processes: list[int], hold: float, emulator: bool) -> None:
    from kvprobe.tables import render_table

    rows = []
    for procs in processes:
        for users in levels:
            m = measure(users, procs, hold, emulator)
            rows.append([m["users"], m["processes"], m["requests"], m["matched"], f"{m['dist_p50']:.1f}",
                         f"{m['dist_p99']:.1f}", f"{m['lag_p99']:.1f}", f"{m['cpu']:.2f}", f"{m['cpu_total']:.2f}",
                         "yes" if m["saturated"] else "no", m["errors"]])
    server = ("kvprobe emulate vllm --trace (server TTFT = its scheduler step)" if emulator
              else f"sse_server.py ttft {TTFT * 1000:g} ms itl {ITL * 1000:g} ms (server TTFT = first write)")
    print(render_table(["streams", "procs", "requests", "matched", "dist p50 ms", "dist p99 ms", "lag p99 ms",
                        "cpu max", "cpu sum", "client sat.", "errors"], rows,
                       title=f"load path: TTFT distortion = client TTFT - server TTFT; P={PROMPT} O={OUT}; "
                             f"{server}; {os.cpu_count()} cpus"), flush=True)


def main(argv: list[str] | None = None) -> None:
    """Default (as `make bench` calls it): the SSE server with 1 and 2 processes, then the emulator
    with 2 processes when it is available."""
    ap = argparse.ArgumentParser(prog="bench_load")
    ap.add_argument("--levels", default="100,250,500")
    ap.add_argument("--processes", default=None)
    ap.add_argument("--hold", type=float, default=6.0)
    ap.add_argument("--emulator", action="store_true")
    args = ap.parse_args(argv if argv is not None else [])
    levels = [int(x) for x in args.levels.split(",")]
    if argv:
        procs = [int(x) for x in (args.processes or "1,2").split(",")]
        sweep(levels, procs, args.hold, args.emulator)
        return
    sweep(levels, [1, 2], args.hold, emulator=False)
    try:
        import kvprobe.cli.emulate  # noqa: F401
    except ImportError:
        print("   (kvprobe.targets.emulator not available: emulator sweep skipped)")
        return
    sweep(levels, [2], args.hold, emulator=True)


if __name__ == "__main__":
    main(sys.argv[1:])
