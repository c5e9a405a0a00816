"""Load hosts: how many streams a probe sustains with k `kvprobe worker` processes, TTFT distortion p99 < 10 ms.

The same measurement as bench_load (client TTFT − server TTFT, per X-Request-Id, against the SSE
server's own trace), but with the load where a fleet probe puts it: a bare Locust master and k
`kvprobe worker --master 127.0.0.1:PORT` processes, each in its own process group, every record
coming back over Locust's messaging. One run per k climbs the levels; the highest level below the
first one whose distortion p99 reaches 10 ms (or whose client saturated) is what k processes sustain.

Read the result as streams per load process on this machine; a load host with C free cores runs
`kvprobe worker --processes C` and holds about C times that. On this shared 2-core box both the
server and the workers compete for the same cores, so the figures are a floor.
Run: `python -m bench.bench_workers [--k 1,2] [--levels 100,200,300,400,600,800] [--hold 4]` (~3 min).
A ">=" figure is a floor: no level broke the limit, or the one that did had healthy workers (the
server or the machine distorted it).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.bench_load import LIFETIME, OUT, PROMPT, Server
from kvprobe.load.health import client_health
from kvprobe.load.runner import LocustRun, free_port

ROOT = Path(__file__).resolve().parent.parent
LIMIT_MS = 10.0  # the distortion p99 a probe's TTFT can bear (locust.md §4: timer noise is ~6 ms)


def _start_workers(k: int, port: int, workdir: Path) -> list[subprocess.Popen]:
    procs = []
    for i in range(k):
        log = open(workdir / f"worker{i}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([sys.executable, "-m", "kvprobe", "worker", "--master", f"127.0.0.1:{port}"],
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True, env=dict(os.environ, PYTHONPATH=str(ROOT))))
    return procs


def _stop_workers(procs: list[subprocess.Popen]) -> None:
    import signal

    for p in procs:
        try:
            p.wait(timeout=10)  # they quit with the master
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)
        if p.stdout:
            p.stdout.close()


def climb(k: int, levels: list[int], hold: float) -> list[dict]:
    """One master with k workers, every level in order (the figures are computed once the load stops)."""
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvp-bench-workers-") as tmp:
        tmp = Path(tmp)
        server = Server(tmp, emulator=False)
        port = free_port()
        workers = _start_workers(k, port, tmp)
        windows = []
        try:
            run = LocustRun(server.url, model="m", prompt_tokens=PROMPT, output_tokens=OUT, workdir=tmp / "locust",
                            time_limit=len(levels) * (hold + 2 * LIFETIME + 10) + 60, token_range=100000,
                            start_jitter=LIFETIME, expect_workers=k, bind_port=port, workers_wait=60)
            with run:
                run.start()
                for users in levels:
                    run.set_users(users)
                    t_level = run.wait_level(users, timeout=60)
                    t0 = t_level + LIFETIME + 1.0  # users start spread over one lifetime
                    t1 = t0 + hold
                    time.sleep(max(0.0, t0 - time.time()))
                    cpu0 = _cpu(server.proc.pid)
                    time.sleep(max(0.0, t1 - time.time()))
                    windows.append((users, t0, t1, (_cpu(server.proc.pid) - cpu0) / hold))
                    run.raise_if_worker_lost()
                time.sleep(LIFETIME + 1.0)  # requests sent in the last window finish
                run.stop()
            recs = run.records()
        finally:
            server.stop()
            _stop_workers(workers)
        srv = server.server_ttft()
    for users, t0, t1, server_cpu in windows:
        reqs = [r for r in recs if r.kind == "request" and r.status == 200 and r.t_send and t0 <= r.t_send <= t1]
        dist = np.array([(r.t_first - r.t_send - srv[r.request_id]) * 1000 for r in reqs if r.request_id in srv])
        health = client_health(recs, t0, t1)
        rows.append({"k": k, "users": users, "requests": len(reqs), "matched": len(dist),
                     "per_worker": "/".join(str(sum(1 for r in reqs if r.worker == f"w{i}")) for i in range(k)),
                     "p50": float(np.percentile(dist, 50)) if len(dist) else math.nan,
                     "p99": float(np.percentile(dist, 99)) if len(dist) else math.nan,
                     "lag": health.lag_p99_ms, "cpu_total": health.cpu_total, "saturated": health.saturated,
                     "server_cpu": server_cpu,
                     "named": health.reason if health.saturated else ""})
    return rows


def _cpu(pid: int) -> float:
    """CPU seconds the SSE server has used: when it nears one core, the server, not the client,
    distorts TTFT (it shares this machine's cores with the workers)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def sustained(rows: list[dict]) -> tuple[int, dict | None]:
    """The highest level below every level that broke the limit, and the level that broke it (None:
    none did, and the figure is only a floor)."""
    best = 0
    for r in rows:
        if not (r["p99"] < LIMIT_MS) or r["saturated"]:
            return best, r
        best = r["users"]
    return best, None


def limited_by(broke: dict | None) -> str:
    """Who distorted the level that broke the limit: a saturated worker names itself; with every
    worker healthy, it was the server or the machine they share, so k processes hold at least this."""
    if broke is None:
        return "nothing within the levels run"
    if broke["saturated"]:
        return f"the client at {broke['users']}: {broke['named']}"
    return (f"the server / machine at {broke['users']} (workers healthy, loop lag p99 {broke['lag']:.1f} ms; "
            f"server cpu {broke['server_cpu']:.2f})")


def main(argv: list[str] | None = None) -> None:
    from kvprobe.tables import render_table

    ap = argparse.ArgumentParser(prog="bench_workers")
    ap.add_argument("--k", default="1,2")
    ap.add_argument("--levels", default="100,200,300,400,600,800")
    ap.add_argument("--hold", type=float, default=4.0)
    args = ap.parse_args(argv if argv is not None else [])
    levels = [int(x) for x in args.levels.split(",")]
    summary = []
    for k in (int(x) for x in args.k.split(",")):
        t = time.monotonic()
        rows = climb(k, levels, args.hold)
        print(render_table(
            ["workers", "streams", "requests", "per worker", "dist p50 ms", "dist p99 ms", "worst lag p99 ms",
             "cpu sum", "server cpu", "client"],
            [[r["k"], r["users"], r["requests"], r["per_worker"], f"{r['p50']:.1f}", f"{r['p99']:.1f}",
              f"{r['lag']:.1f}" if r["lag"] is not None else "—",
              f"{r['cpu_total']:.2f}" if r["cpu_total"] is not None else "—", f"{r['server_cpu']:.2f}",
              r["named"] or "healthy"] for r in rows],
            title=f"{k} kvprobe worker process(es): TTFT distortion = client TTFT - server TTFT; P={PROMPT} O={OUT}; "
                  f"{os.cpu_count()} cpus ({time.monotonic() - t:.0f} s)"), flush=True)
        best, broke = sustained(rows)
        at_least = "" if broke is not None and broke["saturated"] else ">= "
        summary.append([k, f"{at_least}{best}", f"{at_least}{best / k:.0f}" if best else "—",
                        f"{at_least}{best / (LIFETIME / OUT) / k:.0f}" if best else "—", limited_by(broke)])
    print(render_table(["worker processes", f"streams with dist p99 < {LIMIT_MS:g} ms", "streams per process",
                        "chunks/s per process", "limit set by"], summary,
                       title="sizing load hosts: a fleet needing S streams needs about S / (per process) worker "
                             "processes (kvprobe worker --processes N on a host with N free cores)"), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
