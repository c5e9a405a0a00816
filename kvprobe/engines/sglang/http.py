"""SGLang's HTTP face (0.5.23): endpoints, the API key, the fixed-length request, error bodies,
response shapes, and the /v1/models and /server_info bodies the emulator serves."""

from __future__ import annotations

from kvprobe.engines.sglang.versions import DEFAULT_VERSION

DEFAULT_PORT = 30000  # arg_groups/fields/serving.py L65-66
# /health submits a 1-token generate and answers 200 once the scheduler replies (http_server.py L721-799);
# 503 while starting or shutting down.
HEALTH_PATH = "/health"
# /health is a generation: it sleeps 1 s before it looks for any scheduler output, and under load it
# waits for the running batch's next output (http_server.py L723-800; a busy scheduler skips the
# request itself, scheduler.py L2240-2247) — too slow to poll. /ready answers from the tokenizer
# manager's state at once (http_server.py L714-718).
ALIVE_PATH = "/ready"
MODELS_PATH = "/v1/models"  # http_server.py L1993-2022
METRICS_PATH = "/metrics"  # with --enable-metrics, on the API port
# http_server.py L853-892 and L802-850; the `get_` forms are deprecated but still served
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")
GENERATE_PATH = "/generate"  # the native API
HEALTH_GENERATE_PATH = "/health_generate"  # the same handler as /health (http_server.py L721-799)
INFO_PATHS = (SERVER_INFO_PATHS[0], MODELS_PATH)
COMPLETIONS_PATH = "/v1/completions"  # entrypoints/http_server.py L1860-1867


# --- API key (utils/auth.py add_api_key_middleware + decide_request_auth, 0.5.23): with --api-key every
# NORMAL endpoint (/generate, /v1/*, /server_info, /model_info, ...) needs `Authorization: Bearer KEY`;
# OPTIONS and paths starting with these prefixes are always allowed (k8s probes, Prometheus scraping).
API_KEY_ENV = None  # SGLang reads the key from --api-key only
AUTH_EXEMPT_PREFIXES = ("/health", "/ready", "/metrics")
UNAUTHORIZED_STATUS = 401
UNAUTHORIZED_BODY = {"error": "Unauthorized"}  # ORJSONResponse, auth.py L193-202


def auth_required(method: str, path: str) -> bool:
    return method != "OPTIONS" and not path.startswith(AUTH_EXEMPT_PREFIXES)


def bearer_token(authorization: str | None) -> str | None:
    """auth.py `_check_bearer_token`: `split(" ", 1)`, exactly two parts, scheme case-insensitive."""
    if not authorization:
        return None
    parts = authorization.split(" ", 1)
    return parts[1] if len(parts) == 2 and parts[0].lower() == "bearer" else None



def completion_body(prompt_ids: list[int], output_tokens: int, *, model: str | None,
                    stream: bool = True) -> dict:
    body: dict = {"prompt": list(prompt_ids), "max_tokens": output_tokens, "min_tokens": output_tokens,
                  "ignore_eos": True, "stream": stream}
    if model:
        body["model"] = model
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# --- errors (as a real 0.5.23 server answers them)
def error_body(message: str, *, type: str = "BadRequestError", code: int = 400) -> dict:
    """/v1/completions: flat ErrorResponse (openai/serving_base.py create_error_response L205-221)."""
    return {"object": "error", "message": message, "type": type, "param": None, "code": code}


def generate_error_body(message: str) -> dict:
    """/generate: http_server.py `_create_error_response` L2246-2250."""
    return {"error": {"message": message}}


def streaming_abort_chunk(message: str) -> dict:
    """Scheduler-side abort while streaming /v1/completions: one SSE event, HTTP 200
    (create_streaming_error_response L223-238)."""
    return {"error": {"object": "error", "message": message, "type": "BAD_REQUEST", "param": None, "code": 400}}


def bad_request(message: str) -> dict:
    """Pydantic validation errors: 400 (not 422), type "Bad Request" (http_server.py L635-693)."""
    return error_body(message, type="Bad Request")


# --- response shapes (openai/serving_completions.py, protocol.py)
def stream_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "matched_stop": None}], "usage": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def usage_chunk(rid: str, created: int, model: str, prompt_tokens: int, completion_tokens: int,
                version: str = DEFAULT_VERSION) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_response(rid: str, created: int, model: str, text: str, finish_reason: str, prompt_tokens: int,
                        completion_tokens: int, version: str = DEFAULT_VERSION) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "matched_stop": None}], "usage": usage(prompt_tokens, completion_tokens)}


def generate_response(rid: str, text: str, output_ids: list[int], finish_reason: str, prompt_tokens: int,
                      e2e_latency: float, eos_id: int | None = None) -> dict:
    """Native /generate body (cumulative text; meta_info.finish_reason as a dict)."""
    reason = ({"type": "length", "length": len(output_ids)} if finish_reason == "length"
              else {"type": "stop", "matched": eos_id})
    return {"text": text, "output_ids": output_ids,
            "meta_info": {"id": rid, "finish_reason": reason, "prompt_tokens": prompt_tokens,
                          "completion_tokens": len(output_ids), "cached_tokens": 0, "e2e_latency": e2e_latency}}


def models_body(served: str, context_len: int, created: int) -> dict:
    """GET /v1/models (http_server.py L1993-2022)."""
    return {"object": "list", "data": [{"id": served, "object": "model", "created": created, "owned_by": "sglang",
                                        "root": served, "parent": None, "max_model_len": context_len}]}


def server_info_body(*, args: dict, max_total_num_tokens: int, max_req_input_len: int,
                     effective_max_running: int, version: str) -> dict:
    """GET /server_info (utils/common.py build_server_info L3584-3593): resolved args + scheduler info."""
    return {**args, "status": "ready", "max_total_num_tokens": max_total_num_tokens,
            "max_req_input_len": max_req_input_len, "version": version, "frontend": "python",
            "internal_states": [{"effective_max_running_requests_per_dp": effective_max_running,
                                 "last_gen_throughput": 0.0,
                                 "memory_usage": {"token_capacity": max_total_num_tokens}}]}


# Engine steps a request holds its KV before the client sees its first token, net of how its end is
# seen. Overlap scheduling is on by default (event_loop_overlap, scheduler.py L2061–2135): the
# iteration that admits a request launches its prefill batch, and the next one, after launching its
# own batch, processes that result and sends the first token — about one batch after admission. A
# finished request is freed as its last batch's result is processed, when its last token is sent:
# nothing to add at the end. (It was 2, counting the second iteration whole and not the end: the
# streams then read 0.45 above the simulated time average on the 0.5.23 shadow at O=32, 12.13 against
# 11.68, where 1 reads 11.76; on the emulator 0.6-0.8 above the scheduler's own count of 19.4-19.5.)
FIRST_TOKEN_LEAD_STEPS = 1
