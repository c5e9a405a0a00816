"""The emulator under hostile clients: malformed bodies get the engine's status and error shape (never a
500 or a hang), aborted streams and slow readers leak nothing, and the scheduler is never left stuck.

After every test `assert_drained` waits (with a deadline) for running/waiting/in-flight to reach 0,
runs the scheduler's own `check_pool()` (block accounting), checks the usage gauge is 0, and completes
one normal request."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import socket
import threading
import time

import pytest

from tests.emulator.conftest import wait_for

VLLM = {"num-gpu-blocks-override": 400, "max-model-len": 1024}
SGLANG = {"max-total-tokens": 6000, "context-length": 1024, "enable-metrics": True}
GOOD = {"prompt": [11, 12, 13, 14], "max_tokens": 3, "ignore_eos": True}


def raw(port: int, path: str, data: bytes, ctype: str | None = "application/json", timeout: float = 15):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {} if ctype is None else {"Content-Type": ctype}
        conn.request("POST", path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def assert_drained(s, timeout: float = 10.0) -> None:
    """Nothing held: no stream, no request in the scheduler, pool consistent and empty, and it still serves."""
    e = s.emu

    def state():
        st = e.scheduler.stats
        return (st.running, st.waiting, len(e.runtime.streams), len(e.runtime._intake),
                e.scheduler.has_work(), st.used_tokens)

    wait_for(lambda: s.call(state) == (0, 0, 0, 0, False, 0), timeout=timeout,
             what=f"the scheduler to drain (running, waiting, streams, intake, has_work, used): {s.call(state)}")
    s.call(e.scheduler.check_pool)
    m = e.dialect.METRICS
    # the gauges are republished by the loop's next idle pass, a moment after the scheduler empties
    wait_for(lambda: s.value(m.running) == 0 and s.value(m.waiting) == 0, timeout=timeout,
             what="the running and waiting gauges to read 0")
    body = GOOD if e.engine == "vllm" else {**GOOD}
    status, text = s.post("/v1/completions", body)
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3, text
    wait_for(lambda: s.call(state) == (0, 0, 0, 0, False, 0), timeout=timeout, what="drain after the probe")


def vllm_error(status: int, data: bytes) -> None:
    body = json.loads(data)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status and body["error"]["message"]


def sglang_error(status: int, data: bytes) -> None:
    body = json.loads(data)
    assert body["object"] == "error" and body["code"] == status and body["message"], body


def ids(n, start=100):
    return [start + i % 30000 for i in range(n)]


J = json.dumps
# (name, body bytes, content type, expected status) for /v1/completions; 200 = accepted (pydantic lax mode)
COMPLETIONS = [
    ("empty body", b"", "application/json", 400),
    ("not json", b"{not json", "application/json", 400),
    ("json array", b"[1,2,3]", "application/json", 400),
    ("json string", b'"prompt"', "application/json", 400),
    ("json null", b"null", "application/json", 400),
    ("not utf-8", b'{"prompt": "\xff\xfe"}', "application/json", 400),
    ("deep nesting", b"[" * 50_000 + b"]" * 50_000, "application/json", 400),
    ("int past digit limit", b'{"prompt":[1],"max_tokens":' + b"9" * 5000 + b"}", "application/json", 400),
    ("NaN max_tokens", b'{"prompt":[1,2],"max_tokens":NaN}', "application/json", 400),
    ("text/plain", J(GOOD).encode(), "text/plain", 400),
    ("form content type", J(GOOD).encode(), "application/x-www-form-urlencoded", 400),
    ("no content type", J(GOOD).encode(), None, 200),
    ("+json content type", J(GOOD).encode(), "application/vnd.api+json; charset=utf-8", 200),
    ("prompt dict", J({"prompt": {"a": 1}}).encode(), "application/json", 400),
    ("prompt missing", J({"max_tokens": 3}).encode(), "application/json", 400),
    ("prompt of bools", J({"prompt": [True, False]}).encode(), "application/json", 400),
    ("prompt of floats", J({"prompt": [1.5, 2.0]}).encode(), "application/json", 400),
    ("prompt empty list", J({"prompt": []}).encode(), "application/json", 400),
    ("prompt empty text", J({"prompt": ""}).encode(), "application/json", 400),
    ("prompt whitespace", J({"prompt": "   \n\t"}).encode(), "application/json", 400),
    ("max_tokens word", J({**GOOD, "max_tokens": "three"}).encode(), "application/json", 400),
    ("max_tokens int string", J({**GOOD, "max_tokens": "3"}).encode(), "application/json", 200),
    ("max_tokens integral float", J({**GOOD, "max_tokens": 3.0}).encode(), "application/json", 200),
    ("max_tokens fractional", J({**GOOD, "max_tokens": 3.5}).encode(), "application/json", 400),
    ("max_tokens bool", J({**GOOD, "max_tokens": True}).encode(), "application/json", 200),
    ("max_tokens list", J({**GOOD, "max_tokens": [3]}).encode(), "application/json", 400),
    ("max_tokens -1", J({**GOOD, "max_tokens": -1}).encode(), "application/json", 400),
    ("max_tokens 0", J({**GOOD, "max_tokens": 0}).encode(), "application/json", 400),
    ("max_tokens 1e12", J({**GOOD, "max_tokens": 10**12}).encode(), "application/json", 400),
    ("min_tokens -1", J({**GOOD, "min_tokens": -1}).encode(), "application/json", 400),
    ("min_tokens > max", J({**GOOD, "min_tokens": 50}).encode(), "application/json", 400),
    ("ignore_eos yes", J({**GOOD, "ignore_eos": "yes"}).encode(), "application/json", 200),
    ("ignore_eos maybe", J({**GOOD, "ignore_eos": "maybe"}).encode(), "application/json", 400),
    ("ignore_eos 2", J({**GOOD, "ignore_eos": 2}).encode(), "application/json", 400),
    ("stream dict", J({**GOOD, "stream": {}}).encode(), "application/json", 400),
    ("stream_options list", J({**GOOD, "stream": True, "stream_options": [1]}).encode(), "application/json", 400),
    ("model dict", J({**GOOD, "model": {"x": 1}}).encode(), "application/json", 400),
    ("unknown fields", J({**GOOD, "frobnicate": 1, "nested": {"a": [1]}}).encode(), "application/json", 200),
    ("prompt of 1e6 ids", J({"prompt": ids(10**6), "max_tokens": 3}).encode(), "application/json", 400),
    ("token id -1", J({"prompt": [5, -1, 6], "max_tokens": 3}).encode(), "application/json", 400),
    ("token id 2**31", J({"prompt": [5, 2**31], "max_tokens": 3}).encode(), "application/json", 400),
    ("token id 2**70", J({"prompt": [5, 2**70], "max_tokens": 3}).encode(), "application/json", 400),
    ("token id 2**31-1", J({"prompt": [5, 2**31 - 1], "max_tokens": 3, "ignore_eos": True}).encode(),
     "application/json", 200),
]


@pytest.fixture(params=["vllm", "sglang"])
def engine_server(request, serve):
    return serve(request.param, VLLM if request.param == "vllm" else SGLANG)


def test_malformed_completions(engine_server):
    s = engine_server
    check = vllm_error if s.emu.engine == "vllm" else sglang_error
    failures = []
    for name, data, ctype, want in COMPLETIONS:
        if s.emu.engine == "sglang" and name == "min_tokens -1":
            want = 400  # SGLang: min_new_tokens must be in [0, max_new_tokens]
        status, body = raw(s.port, "/v1/completions", data, ctype)
        if status != want:
            failures.append(f"{name}: {status} (want {want}) {body[:200]!r}")
            continue
        if status != 200:
            check(status, body)
    assert not failures, "\n".join(failures)
    assert_drained(s)


def test_vllm_null_max_tokens_fills_the_context(serve):
    s = serve("vllm", VLLM)
    status, text = s.post("/v1/completions", {"prompt": ids(1000), "max_tokens": None, "ignore_eos": True})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 1024 - 1000, text
    assert_drained(s)


GEN = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
GENERATE = [
    ("empty body", b"", 400),
    ("not json", b"{", 400),
    ("array", b"[]", 400),
    ("sampling_params list", J({**GEN, "sampling_params": [1]}).encode(), 400),
    ("max_new_tokens string word", J({**GEN, "sampling_params": {"max_new_tokens": "x"}}).encode(), 400),
    ("max_new_tokens -1", J({**GEN, "sampling_params": {"max_new_tokens": -1}}).encode(), 400),
    ("max_new_tokens 1e12", J({**GEN, "sampling_params": {"max_new_tokens": 10**12}}).encode(), 400),
    ("min_new_tokens -5", J({**GEN, "sampling_params": {"max_new_tokens": 3, "min_new_tokens": -5}}).encode(), 400),
    ("input_ids dict", J({"input_ids": {"a": 1}}).encode(), 400),
    ("input_ids negative", J({"input_ids": [-3, 4]}).encode(), 400),
    ("input_ids huge", J({"input_ids": [2**40]}).encode(), 400),
    ("input_ids empty", J({"input_ids": []}).encode(), 400),
    ("no input", J({"sampling_params": {}}).encode(), 400),
    ("max_new_tokens 0", J({**GEN, "sampling_params": {"max_new_tokens": 0}}).encode(), 200),
    ("ignore_eos yes", J({**GEN, "sampling_params": {"max_new_tokens": 2, "ignore_eos": "yes"}}).encode(), 200),
    ("unknown fields", J({**GEN, "extra": [1, 2]}).encode(), 200),
]


def test_malformed_generate(serve):
    s = serve("sglang", SGLANG)
    failures = []
    for name, data, want in GENERATE:
        status, body = raw(s.port, "/generate", data)
        if status != want:
            failures.append(f"{name}: {status} (want {want}) {body[:200]!r}")
        elif status == 400:
            parsed = json.loads(body)
            assert "message" in parsed or "message" in parsed.get("error", {}), (name, parsed)
    assert not failures, "\n".join(failures)
    assert_drained(s)


# --- aborted streams: disconnect before headers, after the first token, mid-stream

def _stream_request(port: int, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(data), data))


async def _abort_one(port: int, body: dict, point: str, rng: random.Random) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        req = _stream_request(port, body)
        if point == "mid-request":  # the body never completes
            writer.write(req[: len(req) // 2])
            await writer.drain()
            await asyncio.sleep(rng.random() * 0.01)
            return point
        writer.write(req)
        await writer.drain()
        if point == "before-headers":
            return point
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        if point == "after-headers":
            return point
        await asyncio.wait_for(reader.readuntil(b"data: "), 10)  # the first token event
        if point == "mid-stream":
            for _ in range(rng.randint(1, 20)):
                await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)
        return point
    finally:
        writer.transport.abort()  # RST, no graceful close


def run_aborts(port: int, n: int, concurrency: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    points = ["mid-request", "before-headers", "after-headers", "first-token", "mid-stream"]

    async def main():
        sem = asyncio.Semaphore(concurrency)
        counts: dict[str, int] = {}

        async def one(i):
            body = {"prompt": ids(rng.randint(1, 300), start=100 + i), "max_tokens": rng.randint(20, 200),
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with sem:
                p = await _abort_one(port, body, rng.choice(points), rng)
            counts[p] = counts.get(p, 0) + 1

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 60)
        return counts

    return asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_thousands_of_aborted_streams(serve, engine):
    flags = {**(VLLM if engine == "vllm" else SGLANG), **({"max-num-seqs": 64} if engine == "vllm" else
                                                         {"max-running-requests": 64})}
    s = serve(engine, flags)
    counts = run_aborts(s.port, n=2000, concurrency=200, seed=7)
    assert sum(counts.values()) == 2000 and len(counts) == 5, counts
    assert_drained(s, timeout=20)
    if engine == "vllm":  # every request that reached the engine was aborted, none succeeded
        assert s.value("vllm:request_success", finished_reason="abort") > 500


def test_some_aborted_streams(serve):
    s = serve("vllm", VLLM)
    counts = run_aborts(s.port, n=200, concurrency=50, seed=3)
    assert sum(counts.values()) == 200
    assert_drained(s)


# --- slow readers

class SlowReader(threading.Thread):
    """A streamed request whose client reads one byte per `interval` seconds (small receive buffer)."""

    def __init__(self, port: int, max_tokens: int, interval: float, stop: threading.Event):
        super().__init__(daemon=True)
        self.port, self.max_tokens, self.interval, self.stop = port, max_tokens, interval, stop
        self.read = 0

    def run(self):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", self.port))
        try:
            sock.sendall(_stream_request(self.port, {"prompt": ids(50), "max_tokens": self.max_tokens,
                                                     "ignore_eos": True, "stream": True}))
            while not self.stop.is_set():
                if not sock.recv(1):
                    break
                self.read += 1
                time.sleep(self.interval)
        finally:
            sock.close()


def test_slow_readers_do_not_block_others_or_the_loop(serve):
    s = serve("vllm", {**VLLM, "num-gpu-blocks-override": 2000, "max-model-len": 4096})
    stop = threading.Event()
    slow = [SlowReader(s.port, max_tokens=3000, interval=0.05, stop=stop) for _ in range(8)]
    for t in slow:
        t.start()
    try:
        wait_for(lambda: s.value("vllm:num_requests_running") >= 8, what="the slow readers to run")
        steps0, model0 = s.value("kvprobe_emulator_steps"), s.value("kvprobe_emulator_model_seconds")
        lost0 = s.value("kvprobe_emulator_lag_seconds")
        t0 = time.monotonic()
        for _ in range(5):  # fast clients complete while the slow ones stall their sockets
            status, text = s.post("/v1/completions", {**GOOD, "max_tokens": 20}, )
            assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 20
        fast = time.monotonic() - t0
        model = s.value("kvprobe_emulator_model_seconds") - model0
        lag = s.value("kvprobe_emulator_lag_seconds") - lost0 + s.value("kvprobe_emulator_step_lag_seconds")
        assert s.value("kvprobe_emulator_steps") > steps0 and model > 0
        assert lag / model < 0.5, (lag, model)  # the step loop kept its timeline while writes piled up
        assert fast < 20 * model + 5  # the fast requests took about their modelled time, not the slow ones'
        assert all(t.is_alive() for t in slow) and all(t.read > 0 for t in slow)
    finally:
        stop.set()
        for t in slow:
            t.join(5)
    assert_drained(s, timeout=15)
