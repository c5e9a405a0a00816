"""HTTP face of the emulator (aiohttp): the engine's endpoints, request validation and SSE streaming.

Every body shape, message and status code comes from the dialect module; this file only routes.
A client that disconnects (handler cancelled or a write fails) aborts its request in the runtime.
"""

from __future__ import annotations

import json
import os
import time

from aiohttp import web

from kvprobe.targets.emulator.bodies import (
    DECODE_ERRORS,
    BadRequest,
    bool_field,
    dict_field,
    int_field,
    parse_prompt,
    read_json_object,
    token_problem,
)
from kvprobe.targets.emulator.faults import GARBAGE_METRICS, dropped_families
from kvprobe.targets.emulator.tokens import EOS_TOKEN_ID, token_text

_DUMPS = json.JSONEncoder(separators=(",", ":")).encode  # pydantic model_dump_json is compact
_MARK = "\x00TOKEN\x00"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def _json(body: dict, status: int = 200) -> web.Response:
    return web.Response(body=_DUMPS(body).encode(), status=status, content_type="application/json")


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else _DUMPS(obj)).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


async def collect(stream) -> list[int]:
    """Every token of a non-streamed request, once the scheduler finished it."""
    tokens: list[int] = []
    while True:
        batch, done = await stream.take()
        tokens += batch
        if done:
            return tokens


class Handlers:
    def __init__(self, emu):
        self.emu = emu
        self.d = emu.dialect
        self.inflight = 0

    # --- common endpoints
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        e = self.emu
        if e.engine == "vllm":
            return _json(self.d.models_body(e.served_model_name, e.model, e.max_model_len, e.created))
        return _json(self.d.models_body(e.served_model_name, e.max_model_len, e.created))

    async def metrics(self, request: web.Request) -> web.Response:
        e = self.emu
        if not e.metrics_enabled:
            return _json({"detail": "Not Found"}, 404)  # the real route is not mounted without --enable-metrics
        headers = {"Content-Type": e.metrics.CONTENT_TYPE}
        if "metrics-garbage" in e.faults:
            return web.Response(body=GARBAGE_METRICS, headers=headers)
        serving_for = None if e.t_serving is None else time.monotonic() - e.t_serving
        drop = dropped_families(e.faults, self.d.METRICS, serving_for)
        prefix = None if e.stats_enabled else self.d.STATS_FAMILY_PREFIX
        return web.Response(body=e.metrics.exposition(drop, prefix), headers=headers)

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": self.emu.version})

    async def dev_server_info(self, request: web.Request) -> web.Response:
        return _json(self.emu.dev_server_info())

    async def load(self, request: web.Request) -> web.Response:
        return _json({"server_load": self.inflight})

    async def server_info(self, request: web.Request) -> web.Response:
        return _json(self.emu.server_info())

    async def model_info(self, request: web.Request) -> web.Response:
        e = self.emu
        return _json({"model_path": e.model, "served_model_name": e.served_model_name, "tokenizer_path": e.model,
                      "is_generation": True, "model_type": "emulated", "architectures": ["EmulatedForCausalLM"]})

    # --- generation
    def _error(self, body: dict, status: int) -> web.Response:
        return _json(body, status)

    def _bad_request(self, message: str) -> web.Response:
        return _json(self.d.bad_request(message), 400)

    async def completions(self, request: web.Request) -> web.Response:
        e, d = self.emu, self.d
        try:
            body = await read_json_object(request)
            ids, was_text = parse_prompt(body.get("prompt"))
            max_tokens = int_field(body, "max_tokens", 16)  # default 16 on both engines
            min_tokens = int_field(body, "min_tokens", 0)
            stream = bool_field(body, "stream")
            include_usage = bool_field(dict_field(body, "stream_options"), "include_usage")
            ignore_eos = bool_field(body, "ignore_eos")
            model = body.get("model")
            if model is not None and not isinstance(model, str):
                raise BadRequest("model: Input should be a valid string")
        except DECODE_ERRORS as err:
            return self._bad_request(str(err))
        if e.engine == "vllm" and "max_tokens" in body and body["max_tokens"] is None:
            max_tokens = max(0, e.max_model_len - len(ids))  # null: as many as fit (api_utils.get_max_tokens)
        if e.engine == "vllm":
            if model is not None and model not in (e.served_model_name, e.model):
                return self._error(d.unknown_model_error(model, e.version), 404)
            if body.get("stream_options") is not None and not stream:
                return self._bad_request(d.STREAM_OPTIONS_ERROR)
            max_tokens, err = d.check_lengths(len(ids), max_tokens, min_tokens, e.max_model_len,
                                              text_prompt=was_text, version=e.version)
            if err is not None:
                return self._error(err, err.get("error", err)["code"])
            if min_tokens < 0:
                return self._error(d.error_body(d.MIN_TOKENS_NEGATIVE.format(min_tokens), version=e.version), 400)
            if msg := token_problem(ids):
                return self._error(d.error_body(msg, version=e.version), 400)
        else:
            if max_tokens <= 0:
                return self._bad_request("max_tokens must be positive")
            msg = d.check_tokenizer(len(ids), max_tokens, min_tokens, e.max_model_len)
            if msg:
                return self._error(d.error_body(msg), 400)
            msg = d.check_scheduler(len(ids), e.max_req_input_len) or token_problem(ids)
            if msg:
                if stream:  # the scheduler aborts after the 200 went out
                    return await self._sse_error(request, _sse(d.streaming_abort_chunk(msg)))
                return self._error(d.error_body(msg), 400)
            max_tokens = d.clip_max_new(len(ids), max_tokens, context_len=e.max_model_len,
                                        max_total_num_tokens=e.pool_tokens_reported, page_size=e.page_size)
            min_tokens = min(min_tokens, max_tokens)
        created = int(time.time())
        name = model or e.served_model_name
        trace_id = request.headers.get("X-Request-Id")
        if stream:
            return await self._stream_completion(request, ids, max_tokens, min_tokens, ignore_eos, trace_id,
                                                 created, name, include_usage)
        s = e.runtime.submit(ids, max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, stream=False,
                             trace_id=trace_id)
        self.inflight += 1
        try:
            tokens = await collect(s)
            if s.finish_reason == "abort":
                return _json(d.error_body("Request aborted", type="InternalServerError", code=500), 500)
            text = "".join(token_text(t) for t in tokens)
            return _json(d.completion_response(s.rid, created, name, text, s.finish_reason, s.prompt_len,
                                               len(tokens), version=e.version))
        finally:
            self.inflight -= 1
            if not s.done:
                e.runtime.abort(s.rid)

    async def _sse_error(self, request: web.Request, event: bytes) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(event + DONE)
        await resp.write_eof()
        return resp

    async def _stream_completion(self, request, ids, max_tokens, min_tokens, ignore_eos, trace_id, created: int,
                                 name: str, include_usage: bool):
        """SSE written by the engine loop itself through a sink: one transport write per token, as
        chunked transfer encoding (the headers are flushed first, so framing is ours from then on)."""
        d, e = self.d, self.emu
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(b"")  # flush the buffered headers now
        transport = request.transport
        rid_box: list = []
        head = tail = b""

        def frame(data: bytes) -> bool:
            if transport is None or transport.is_closing():
                return False
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            return True

        def sink(token: int, reason: str | None) -> bool:
            if reason is None:
                return frame(head + token_text(token).encode() + tail)
            s = rid_box[0]
            data = _sse(d.stream_chunk(s.rid, created, name, token_text(token), reason))
            if include_usage:
                data += _sse(d.usage_chunk(s.rid, created, name, s.prompt_len, len(s.tokens), version=e.version))
            rid_box.append(True)  # the final events went out
            return frame(data + DONE)

        s = e.runtime.submit(ids, max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, stream=True,
                             trace_id=trace_id, sink=sink)
        rid_box.append(s)
        head, tail = _DUMPS(d.stream_chunk(s.rid, created, name, _MARK, None)).split(_DUMPS(_MARK)[1:-1])
        head, tail = b"data: " + head.encode(), tail.encode() + b"\n\n"
        self.inflight += 1
        try:
            while not s.done:
                await s.take()
            if s.finish_reason == "abort" or transport is None or transport.is_closing():
                return resp
            if len(rid_box) == 1:  # finished without a final token event
                data = _sse(d.stream_chunk(s.rid, created, name, "", s.finish_reason))
                if include_usage:
                    data += _sse(d.usage_chunk(s.rid, created, name, s.prompt_len, len(s.tokens), version=e.version))
                frame(data + DONE)
            await resp.write_eof()
            return resp
        finally:
            self.inflight -= 1
            if not s.done:
                e.runtime.abort(s.rid)

    async def generate(self, request: web.Request) -> web.Response:
        """SGLang native /generate: input_ids or text, sampling_params, stream."""
        e, d = self.emu, self.d
        try:
            body = await read_json_object(request)
            ids, _ = parse_prompt(body["input_ids"] if body.get("input_ids") is not None else body.get("text"))
            sp = dict_field(body, "sampling_params")
            max_new = int_field(sp, "max_new_tokens", 128)
            min_new = int_field(sp, "min_new_tokens", 0)
            ignore_eos = bool_field(sp, "ignore_eos")
            stream = bool_field(body, "stream")
        except DECODE_ERRORS as err:  # the app-wide pydantic handler: same body as /v1/completions
            return self._bad_request(str(err))
        msg = (f"max_new_tokens must be at least 0, got {max_new}." if max_new < 0 else None  # SamplingParams.verify
               ) or d.check_tokenizer(len(ids), max_new, min_new, e.max_model_len) or d.check_scheduler(
            len(ids), e.max_req_input_len) or token_problem(ids)
        if msg:
            if stream:
                return await self._sse_error(request, _sse({"error": {"message": msg, "type": "invalid_request_error",
                                                                      "code": 400, "retryable": False}}))
            return _json(d.generate_error_body(msg), 400)
        max_new = d.clip_max_new(len(ids), max_new, context_len=e.max_model_len,
                                 max_total_num_tokens=e.pool_tokens_reported, page_size=e.page_size)
        s = e.runtime.submit(ids, max_new, min_tokens=min(min_new, max_new), ignore_eos=ignore_eos,
                             stream=stream, trace_id=request.headers.get("X-Request-Id"))
        try:
            if not stream:
                tokens = await collect(s)
                return _json(d.generate_response(s.rid, "".join(token_text(t) for t in tokens), tokens,
                                                 s.finish_reason, s.prompt_len, time.monotonic() - s.t_arrival,
                                                 EOS_TOKEN_ID))
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            tokens, text = [], []
            while True:
                batch, done = await s.take()
                tokens += batch
                text += [token_text(t) for t in batch]
                if batch or done:
                    body = d.generate_response(s.rid, "".join(text), [], s.finish_reason or "length", s.prompt_len,
                                               time.monotonic() - s.t_arrival, EOS_TOKEN_ID)
                    body["meta_info"]["completion_tokens"] = len(tokens)
                    if not done:
                        body["meta_info"]["finish_reason"] = None
                    await resp.write(_sse(body) + (DONE if done else b""))
                if done:
                    break
            await resp.write_eof()
            return resp
        finally:
            if not s.done:
                e.runtime.abort(s.rid)


def api_key_middleware(emu):
    """The engine's API-key check (dialect: which paths, which header form, which 401 body)."""
    d, key = emu.dialect, emu.api_key

    @web.middleware
    async def check(request: web.Request, handler):
        if d.auth_required(request.method, request.path) and not key.matches(
                d.bearer_token(request.headers.get("Authorization"))):
            return _json(d.UNAUTHORIZED_BODY, d.UNAUTHORIZED_STATUS)
        return await handler(request)

    return check


def build_app(emu) -> web.Application:
    h = Handlers(emu)
    middlewares = [api_key_middleware(emu)] if emu.api_key is not None else []
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
    app.router.add_get(emu.dialect.HEALTH_PATH, h.health)
    d = emu.dialect
    app.router.add_get(d.MODELS_PATH, h.models)
    app.router.add_get(d.METRICS_PATH, h.metrics)
    app.router.add_post(d.COMPLETIONS_PATH, h.completions)
    if emu.engine == "vllm":
        app.router.add_get(d.VERSION_PATH, h.version)
        app.router.add_get(d.LOAD_PATH, h.load)
        if os.environ.get(d.DEV_MODE_ENV, "0") == "1":  # as envs.py reads it: bool(int(...))
            app.router.add_get(d.SERVER_INFO_PATH, h.dev_server_info)
    else:
        for path in d.SERVER_INFO_PATHS:
            app.router.add_get(path, h.server_info)
        for path in d.MODEL_INFO_PATHS:
            app.router.add_get(path, h.model_info)
        app.router.add_post(d.GENERATE_PATH, h.generate)
        app.router.add_get(d.HEALTH_GENERATE_PATH, h.health)
    if emu.dialect.ALIVE_PATH and emu.dialect.ALIVE_PATH != emu.dialect.HEALTH_PATH:
        app.router.add_get(emu.dialect.ALIVE_PATH, h.health)  # SGLang's /ready: the liveness an attach polls
    return app
