"""A stand-in engine process for launcher tests (run as a script, never imported by kvprobe).

    python fake_engine.py --port P [--mode MODE] [--delay S] [--metrics FILE] [--log FILE]
                          [--pidfile FILE] [--require-key KEY] [--leave-temp-file]

Modes: ok (healthy after --delay), exit (prints an error and exits 3 during start), never (/health
always 503), port-stolen (its port taken while it starts: asyncio's bind error, then it lingers),
ignore-term (ok, but ignores SIGTERM), grandchild (ok, dies on SIGTERM, but first
spawns a child that ignores SIGTERM and writes its pid to --pidfile). Serves /health, /metrics (the --metrics
file), /v1/models and /version in vLLM's shapes; copies --log to stdout as its start-up log.
--leave-temp-file makes a temporary file and never deletes it, as SGLang does for its sockets' names.
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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", default="ok")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--metrics")
    ap.add_argument("--log")
    ap.add_argument("--pidfile")
    ap.add_argument("--require-key")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--leave-temp-file", action="store_true")
    args = ap.parse_args()

    print(f"fake engine starting, mode={args.mode}, pid={os.getpid()}", flush=True)
    if args.leave_temp_file:
        print(f"temp file {tempfile.NamedTemporaryFile(delete=False).name}", flush=True)
    if args.mode == "exit":
        time.sleep(args.delay)
        print("ValueError: No available memory for the cache blocks.", flush=True)
        return 3
    if args.mode == "port-stolen":
        # Another process (SGLang's TCP store, say) binds our port while we start: asyncio's own
        # create_server error, logged as uvicorn logs it, and the process lingers without serving.
        import asyncio
        import socket
        thief = socket.socket()
        thief.bind(("127.0.0.1", args.port))
        thief.listen()

        async def serve():
            await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", args.port)

        try:
            asyncio.run(serve())
        except OSError as exc:
            print(f"ERROR:    {exc}", flush=True)
        time.sleep(600)
        return 1
    if args.mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.mode == "grandchild":
        # The child writes its pid only once it ignores SIGTERM, and we serve only after that:
        # otherwise a fast stop() could kill it before it ignores the signal.
        code = ("import os,signal,sys,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
                "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); "
                "time.sleep(600)")
        subprocess.Popen([sys.executable, "-c", code, args.pidfile])
        deadline = time.monotonic() + 30
        while not os.path.exists(args.pidfile) and time.monotonic() < deadline:
            time.sleep(0.01)
    if args.log:
        with open(args.log) as fh:
            sys.stdout.write(fh.read())
            sys.stdout.flush()

    ready_at = time.monotonic() + args.delay
    metrics = open(args.metrics, "rb").read() if args.metrics else b""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *a):  # the access log would flood the engine log
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802
            if args.require_key and self.headers.get("Authorization") != f"Bearer {args.require_key}":
                return self._send(401, b'{"error":"Unauthorized"}')
            healthy = args.mode != "never" and time.monotonic() >= ready_at
            if self.path == "/health":
                return self._send(200 if healthy else 503, b"")
            if self.path == "/metrics" and metrics:
                return self._send(200, metrics, "text/plain; version=0.0.4")
            if self.path == "/version":
                return self._send(200, b'{"version":"0.33.0"}')
            if self.path == "/v1/models":
                card = {"id": "fake", "object": "model", "max_model_len": args.max_model_len}
                return self._send(200, json.dumps({"object": "list", "data": [card]}).encode())
            return self._send(404, b'{"detail":"Not Found"}')

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"listening on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
