"""vLLM's HTTP face (0.33.0; 0.11.0 / 0.9.2 where they differ): endpoints, the API key, the
fixed-length request, error bodies and length checks, response shapes."""

from __future__ import annotations

from kvprobe.engines.base import ReportedCapacity
from kvprobe.engines.vllm.versions import DEFAULT_VERSION, is_legacy, prompt_tokens_details_written
from kvprobe.releases import version_tuple

DEFAULT_PORT = 8000  # entrypoints/common/cli_args.py L293-296
HEALTH_PATH = "/health"  # 200, empty body; 503 when the engine is dead (serve/instrumentator/health.py L22-33)
MODELS_PATH = "/v1/models"  # openai/models/serving.py show_available_models L64-77
VERSION_PATH = "/version"  # {"version": "0.33.0"} (serve/instrumentator/basic.py L53-56)
LOAD_PATH = "/load"  # {"server_load": n}: in-flight HTTP requests on the generation routes
METRICS_PATH = "/metrics"  # Prometheus text (serve/instrumentator/metrics.py attach_router L56-81)
# With VLLM_SERVER_DEV_MODE=1 the server mounts /server_info (entrypoints/launchers/api_server/routers.py
# L46-49; serve/dev/server_info/api_router.py L43-60): the whole VllmConfig, scheduler limits included.
SERVER_INFO_PATH = "/server_info"
INFO_PATHS = (MODELS_PATH, VERSION_PATH)
OPTIONAL_INFO_PATHS = (SERVER_INFO_PATH + "?config_format=json",)
COMPLETIONS_PATH = "/v1/completions"  # entrypoints/openai/completion/api_router.py


# --- API key (entrypoints/serve/middleware/register.py L32-36, authenticate.py, 0.33.0): --api-key wins over
# VLLM_API_KEY (envs.py L829); only paths under these prefixes are guarded, OPTIONS never is; /health,
# /metrics, /version, /load stay open. Mismatch or a missing/non-Bearer header -> 401 with this body.
API_KEY_ENV = "VLLM_API_KEY"
AUTH_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
UNAUTHORIZED_STATUS = 401
UNAUTHORIZED_BODY = {"error": "Unauthorized"}


def auth_required(method: str, path: str) -> bool:
    """Does the AuthenticationMiddleware check this request (authenticate.py `__call__`)?"""
    return method != "OPTIONS" and path.startswith(AUTH_GUARDED_PREFIXES)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header (scheme case-insensitive, split at the
    first space, as authenticate.py `verify_token`); None when absent or another scheme."""
    if not authorization:
        return None
    scheme, _, param = authorization.partition(" ")
    return param if scheme.lower() == "bearer" else None



def completion_body(prompt_ids: list[int], output_tokens: int, *, model: str | None,
                    stream: bool = True) -> dict:
    """The fixed-length request: ignore_eos, min_tokens = max_tokens = O."""
    body: dict = {"prompt": list(prompt_ids), "max_tokens": output_tokens, "min_tokens": output_tokens,
                  "ignore_eos": True, "stream": stream}
    if model:
        body["model"] = model
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# --- error bodies and length checks (entrypoints/serve/exception_handling/error_response.py L14-108)
def error_body(message: str, *, type: str = "BadRequestError", param: str | None = None, code: int = 400,
               version: str = DEFAULT_VERSION) -> dict:
    """Nested `{"error": {...}}` from 0.10.1 (0.11.0 and 0.33.0 read); flat `{"object": "error", ...}` through
    0.10.0 (entrypoints/openai/protocol.py ErrorResponse: 0.10.0 L80-85 flat, 0.10.1 L90-98 nested)."""
    info = {"message": message, "type": type, "param": param, "code": code}
    if version_tuple(version) < (0, 10, 1):
        return {"object": "error", **info}
    return {"error": info}


def check_lengths(prompt_len: int, max_tokens: int, min_tokens: int, max_model_len: int, *,
                  text_prompt: bool = False, version: str = DEFAULT_VERSION) -> tuple[int, dict | None]:
    """-> (effective max_tokens, error body or None). Order of completion/serving.py `_create_completion`
    L131-200 (0.33.0); messages as a real 0.33.0 server answers them."""
    m = max_model_len

    def err(msg, param=None, value=None):
        if param is not None:
            msg = f"{msg} (parameter={param}, value={value})"  # VLLMValidationError.__str__, exceptions.py L49-57
        return max_tokens, error_body(msg, param=param, version=version)

    if is_legacy(version):
        # 0.11.0 entrypoints/renderer.py L384-387 with max_length = max_model_len - max_tokens
        if prompt_len + max_tokens > m:
            return err(f"This model's maximum context length is {m - max_tokens} tokens. However, your request "
                       f"has {prompt_len} input tokens. Please reduce the length of the input messages.")
    else:
        if max_tokens > m:  # renderers/params.py L270-284
            return err(f"max_tokens={max_tokens} cannot be greater than max_model_len={m}. Please request fewer "
                       "output tokens.", "max_tokens", max_tokens)
        if prompt_len > m:  # params.py L531-552; text is tokenized with truncation to M+1 ("at least")
            shown = m + 1 if text_prompt else prompt_len
            at_least = "at least " if shown == m + 1 else ""
            return err(f"This model's maximum context length is {m} tokens. However, your prompt contains "
                       f"{at_least}{shown} input tokens, which exceeds this limit even without any output tokens. "
                       "Please reduce the length of the input prompt.", "input_tokens", shown)
        max_tokens = min(max_tokens, m - prompt_len)  # api_utils.get_max_tokens L234-270: silent clamp
    if max_tokens < 1:  # sampling_params.py L691-696
        return err(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if min_tokens > max_tokens:  # sampling_params.py L701-705: no parameter, param null
        return err(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    return max_tokens, None


def unknown_model_error(model: str, version: str = DEFAULT_VERSION) -> dict:
    """openai/models/serving.py L55-62: 404."""
    return error_body(f"The model `{model}` does not exist.", type="NotFoundError", param="model", code=404,
                      version=version)


def bad_request(message: str, version: str = DEFAULT_VERSION) -> dict:
    """Pydantic validation failures: 400 with type "Bad Request" (handlers/validation.py L149-195)."""
    return error_body(message, type="Bad Request", version=version)


MIN_TOKENS_NEGATIVE = "min_tokens must be greater than or equal to 0, got {}."  # sampling_params.py L697-699
STREAM_OPTIONS_ERROR = "Stream options can only be defined when `stream=True`."  # completion/protocol.py L599-610


# --- response shapes (completion/serving.py; non-stream body as a real 0.33.0 server answers)
def stream_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "stop_reason": None}], "usage": None}


def usage(prompt_tokens: int, completion_tokens: int, version: str = DEFAULT_VERSION) -> dict:
    body = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}
    if prompt_tokens_details_written(version):
        body["prompt_tokens_details"] = None
    return body


def usage_chunk(rid: str, created: int, model: str, prompt_tokens: int, completion_tokens: int,
                version: str = DEFAULT_VERSION) -> dict:
    """The last chunk before `data: [DONE]` with include_usage: choices [] (serving.py L500-547)."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, version)}


def completion_response(rid: str, created: int, model: str, text: str, finish_reason: str, prompt_tokens: int,
                        completion_tokens: int, version: str = DEFAULT_VERSION) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                         "prompt_token_ids": None, "routed_experts": None, "weight_versions": None}],
            "service_tier": None, "system_fingerprint": f"vllm-{version}-emulated",
            "usage": {**usage(prompt_tokens, completion_tokens, version), "completion_tokens_details": None},
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def models_body(served: str, root: str, max_model_len: int, created: int) -> dict:
    """GET /v1/models (openai/models/serving.py::show_available_models L64-77)."""
    perm = {"id": f"modelperm-{created:x}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}
    return {"object": "list", "data": [{"id": served, "object": "model", "created": created, "owned_by": "vllm",
                                        "root": root, "parent": None, "max_model_len": max_model_len,
                                        "permission": [perm]}]}

# Engine steps between admission and the first streamed token: the step that schedules the whole
# prompt samples the first token (chunked prefill of a prompt within the token budget, sync view).
FIRST_TOKEN_LEAD_STEPS = 1


def length_limit(reported: ReportedCapacity) -> tuple[int, int] | None:
    """(max_model_len, HTTP status of a fixed-length request one token past it). 0.33 clamps
    max_tokens to max_model_len − P and then refuses min_tokens = O > max_tokens with 400
    (sampling_params.py L701–705); 0.11 refused P + max_tokens > max_model_len with 400 outright."""
    return None if reported.max_model_len is None else (int(reported.max_model_len), 400)
