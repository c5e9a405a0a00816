"""Request bodies of the emulator: decoded and validated as the engines' pydantic models do (lax
mode), with the same one-line errors; the prompt as token ids."""

from __future__ import annotations

from aiohttp import web

from kvprobe.targets.emulator.tokens import text_to_ids


class BadRequest(Exception):
    pass


# What a hostile body may raise while it is decoded: bad JSON (ValueError, incl. an int past Python's
# digit limit), bytes that are not UTF-8, nesting past the recursion limit.
DECODE_ERRORS = (BadRequest, ValueError, UnicodeDecodeError, RecursionError)
# Token ids must fit the engines' int32 embedding index / the scheduler's int64 columns. The emulated
# model has no vocabulary of its own (the load uses ids up to ~1e6), so this is the only bound.
TOKEN_ID_LIMIT = 2**31
# pydantic v2 lax-mode booleans (the engines' request models are not strict)
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def int_field(body: dict, key: str, default):
    """pydantic v2 lax int: ints, bools, integral floats and integer strings; null -> default."""
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    if not isinstance(value, int):
        raise BadRequest(f"{key}: Input should be a valid integer")
    return value


def bool_field(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise BadRequest(f"{key}: Input should be a valid boolean")


def dict_field(body: dict, key: str) -> dict:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{key}: Input should be a valid dictionary or object")
    return value


def parse_prompt(prompt) -> tuple[list[int], bool]:
    """-> (token ids, was text). Text goes through the emulator's whitespace rule (tokens.py)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return text_to_ids(prompt), True
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt), False
    raise BadRequest("prompt: expected a string or a list of token ids (batched prompts are not emulated)")


def token_problem(ids: list[int]) -> str | None:
    """After the length checks, as vLLM's input processor does: empty prompt, ids out of range."""
    if not ids:
        return "The decoder prompt cannot be empty"  # v1/engine/input_processor.py L565-566 (0.33.0)
    lo, hi = min(ids), max(ids)
    if lo < 0:  # renderers/base.py validate_token_ids L480-489
        return f"Token id {lo} is out of vocabulary"
    if hi >= TOKEN_ID_LIMIT:
        return f"Token id {hi} is out of vocabulary"
    return None


async def read_json_object(request: web.Request) -> dict:
    """FastAPI parses the body as JSON only without a Content-Type or with application/json or
    application/*+json; anything else reaches the pydantic model as bytes and fails validation."""
    ctype = request.headers.get("Content-Type")
    if ctype is not None:
        main, _, sub = ctype.partition(";")[0].strip().lower().partition("/")
        if main != "application" or not (sub == "json" or sub.endswith("+json")):
            raise BadRequest("Input should be a valid dictionary or object")
    body = await request.json()
    if not isinstance(body, dict):
        raise BadRequest("Input should be a valid dictionary or object")
    return body
