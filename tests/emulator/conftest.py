"""An emulator served over real HTTP on 127.0.0.1 from a background thread, and small clients."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvprobe.targets.emulator.app import Emulator, Settings, start_server, stop_server
from kvprobe.theory.sim.steptime import TimeModel


class Served:
    """Emulator + aiohttp server in a thread with its own event loop; `stop()` joins it."""

    def __init__(self, settings: Settings):
        self.emu = Emulator(settings)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.port = asyncio.run_coroutine_threadsafe(
            start_server(self.emu, "127.0.0.1", 0), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def call(self, fn, timeout=10):
        """Run fn() on the server's loop (scheduler state is only touched there)."""
        async def wrap():
            return fn()
        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(timeout)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(stop_server(self.emu, self.runner), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    # --- sync clients
    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 20):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body)
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.getheader("Content-Type"), resp.read().decode()
        finally:
            conn.close()

    def post(self, path: str, body: dict):
        status, ctype, text = self.request("POST", path, body)
        return status, text

    def sse(self, path: str, body: dict) -> tuple[int, list[str]]:
        status, _, text = self.request("POST", path, body)
        events = [blk[len("data: "):] for blk in text.split("\n\n") if blk.startswith("data: ")]
        return status, events

    def families(self) -> dict:
        status, _, text = self.request("GET", "/metrics")
        assert status == 200, text
        return {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, family: str, families: dict | None = None, **labels) -> float:
        """One metric's value, from `families` (one scrape, to compare gauges published together) or a new scrape."""
        fam = (families or self.families())[family]
        return sum(s.value for s in fam.samples
                   if s.name in (family, family + "_total") and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_for(cond, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


FAST = TimeModel(step_ms=2.0, prefill_us_per_token=0.0, decode_us_per_seq=0.0)


@pytest.fixture
def serve():
    started: list[Served] = []

    def make(engine: str, flags: dict, **kw) -> Served:
        kw.setdefault("time_model", FAST)
        s = Served(Settings(engine=engine, model=kw.pop("model", "test/model"), flags=flags, **kw))
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


class StreamClients:
    """N concurrent streamed completions from one asyncio loop in a thread; hold open until released."""

    def __init__(self, url: str, bodies: list[dict]):
        self.url, self.bodies = url, bodies
        self.results: list[dict | None] = [None] * len(bodies)
        self.tokens = [0] * len(bodies)  # tokens each stream has received so far, live
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.loop.run_until_complete(self._main())

    async def _one(self, session, i, body):
        out = {"tokens": 0, "usage": None, "status": None}
        async with session.post(self.url + "/v1/completions", json=body) as resp:
            out["status"] = resp.status
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out["usage"] = chunk["usage"]
                out["tokens"] += len(chunk.get("choices") or [])
                self.tokens[i] = out["tokens"]
        self.results[i] = out

    async def _main(self):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            self.tasks = [asyncio.ensure_future(self._one(session, i, b)) for i, b in enumerate(self.bodies)]
            await asyncio.gather(*self.tasks, return_exceptions=True)

    def cancel(self):
        """Disconnect every client (closes their connections)."""
        def cancel_all():
            for t in self.tasks:
                t.cancel()
        self.loop.call_soon_threadsafe(cancel_all)
        self.thread.join(10)

    def join(self, timeout=30):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "clients did not finish"
        return self.results
