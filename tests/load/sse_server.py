"""A small vLLM-shaped /v1/completions SSE server for the load tests and the load benchmark.

Real aiohttp on 127.0.0.1, run as a subprocess: `python sse_server.py --port 0 [--ttft S] [--itl S]
[--trace FILE]`. It prints `PORT <n>` on stdout once listening. Chunks look like vLLM 0.x's
(`data: {"id":..,"object":"text_completion","choices":[{"index":0,"text":"tok",...}],"usage":null}`),
then a usage-only chunk (`"choices":[]`), then `data: [DONE]`.

Models with special behaviour: "wrong-usage" reports completion_tokens = max_tokens + 1;
"http-400" answers 400 with a JSON error. `--trace` writes one JSON line per request with the
server's own arrival and first-write times (epoch s), keyed by X-Request-Id.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time

from aiohttp import web


def _chunk(rid: str, text: str | None, usage: dict | None = None) -> bytes:
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": None,
                                        "stop_reason": None}]
    obj = {"id": rid, "object": "text_completion", "created": 0, "model": "m", "choices": choices, "usage": usage}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Server:
    def __init__(self, ttft: float, itl: float, trace: str | None):
        self.ttft, self.itl = ttft, itl
        self.trace_fh = open(trace, "a") if trace else None  # noqa: SIM115
        self.trace_buf: list[str] = []
        self.active = 0
        self.requests = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        t_arr = time.time()
        body = await request.json()
        self.requests += 1
        rid = request.headers.get("X-Request-Id", f"r{self.requests}")
        model = body.get("model")
        if model == "http-400":
            return web.json_response({"error": {"message": "bad request for testing", "code": 400}}, status=400)
        prompt = body.get("prompt")
        p = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        o = int(body.get("max_tokens") or 16)
        usage = {"prompt_tokens": p, "completion_tokens": o + (1 if model == "wrong-usage" else 0),
                 "total_tokens": p + o}
        start = time.monotonic()
        if not body.get("stream"):
            await asyncio.sleep(self.ttft + self.itl * (o - 1))
            return web.json_response({"id": rid, "object": "text_completion", "model": model,
                                      "choices": [{"index": 0, "text": "tok" * o, "finish_reason": "length"}],
                                      "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        self.active += 1
        try:
            for i in range(o):
                delay = start + self.ttft + i * self.itl - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if i == 0:
                    t_first = time.time()
                    if self.trace_fh:
                        self.trace_buf.append(json.dumps({
                            "request_id": rid, "t_arrival": t_arr, "t_first": t_first,
                            "first_id": prompt[0] if isinstance(prompt, list) and prompt else None,
                            "prompt_len": p, "auth": request.headers.get("Authorization")}))
                await resp.write(_chunk(rid, "tok"))
            await resp.write(_chunk(rid, None, usage))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        finally:
            self.active -= 1
        return resp

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response({"active": self.active, "requests": self.requests})

    def flush_trace(self) -> None:
        if self.trace_fh and self.trace_buf:
            buf, self.trace_buf = self.trace_buf, []
            self.trace_fh.write("\n".join(buf) + "\n")
            self.trace_fh.flush()

    async def flusher(self, _app) -> None:
        async def loop():
            while True:
                await asyncio.sleep(0.5)
                self.flush_trace()

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        self.flush_trace()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ttft", type=float, default=0.01)
    ap.add_argument("--itl", type=float, default=0.01)
    ap.add_argument("--trace", default=None)
    args = ap.parse_args(argv)
    srv = Server(args.ttft, args.itl, args.trace)
    app = web.Application()
    app.router.add_post("/v1/completions", srv.completions)
    app.router.add_get("/health", srv.health)
    app.router.add_get("/stats", srv.stats)
    app.cleanup_ctx.append(srv.flusher)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(2048)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    web.run_app(app, sock=sock, print=None, access_log=None, backlog=2048)
    sys.exit(0)


if __name__ == "__main__":
    main()
