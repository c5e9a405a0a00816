"""Single requests the probe sends itself, outside the load: calibration and the length-limit check.

Through the `openai` client (kvprobe.observe.client) in the probe's own process: no gevent here
(Locust runs in its own subprocess). The body is the engine dialect's (`completion_body`): what the
client names is passed as its arguments, every engine field beside them (min_tokens, ignore_eos)
as `extra_body`. An engine that refuses the API key is bad input, said as the key (ConfigError).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

# The completion arguments the client takes by name; any other field of the body is the engine's.
_CLIENT_ARGS = ("model", "prompt", "max_tokens", "stream", "stream_options", "temperature", "top_p", "n", "seed",
                "stop", "logprobs", "echo", "best_of", "suffix", "user")
_COMPLETIONS = "/completions"


@dataclass(frozen=True)
class OneShot:
    """Outcome of one completion request."""

    status: int  # HTTP status, 0 when the connection failed
    seconds: float  # send to end of body
    ttft: float | None  # send to first content chunk (streaming only)
    prompt_tokens: int | None
    completion_tokens: int | None
    body: str  # the error body, or "" on success (never echoed with headers)

    @property
    def ok(self) -> bool:
        return self.status == 200


def post_completion(url: str, body: dict, *, path: str, headers: dict[str, str] | None = None,
                    timeout: float = 60.0) -> OneShot:
    """POST the completion body to `path` (the dialect's COMPLETIONS_PATH) and read it to the end;
    a streaming answer chunk by chunk (the first text is the TTFT, the last chunk's usage the counts)."""
    import openai

    from kvprobe.observe.client import engine_client, is_auth_error, key_refused, split_headers

    if not path.endswith(_COMPLETIONS):
        raise ValueError(f"expected a completions path ending in {_COMPLETIONS}, got {path!r}")
    named = {k: v for k, v in body.items() if k in _CLIENT_ARGS and v is not None}
    extra = {k: v for k, v in body.items() if k not in _CLIENT_ARGS}
    named.setdefault("model", openai.omit)  # the engine's served model when the body names none
    client = engine_client(url, prefix=path[:-len(_COMPLETIONS)], headers=headers, timeout=timeout)
    t0 = time.monotonic()
    try:
        answer = client.completions.create(**named, extra_body=extra or None)
        if not named.get("stream"):
            usage = answer.usage
            return OneShot(200, time.monotonic() - t0, None, usage and usage.prompt_tokens,
                           usage and usage.completion_tokens, "")
        return _read_stream(answer, t0)
    except openai.APIStatusError as err:
        if is_auth_error(err):
            raise key_refused(url, err.status_code, f"POST {path}",
                              key_sent=split_headers(headers)[0] is not None) from None
        return OneShot(err.status_code, time.monotonic() - t0, None, None, None, err.response.text)
    except openai.APIConnectionError as err:  # APITimeoutError included; its message carries no headers
        cause = err.__cause__
        why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        return OneShot(0, time.monotonic() - t0, None, None, None, f"{type(err).__name__}: {err}{why}")
    except openai.APIError as err:  # an error event inside a 200 stream (SGLang's scheduler-side abort)
        return OneShot(400, time.monotonic() - t0, None, None, None, json.dumps({"error": err.body}))
    finally:
        client.close()


def _read_stream(stream, t0: float) -> OneShot:
    ttft = None
    usage = None
    with stream:
        for chunk in stream:
            if ttft is None and any(c.text for c in chunk.choices or []):
                ttft = time.monotonic() - t0
            if chunk.usage:
                usage = chunk.usage
    return OneShot(200, time.monotonic() - t0, ttft, usage and usage.prompt_tokens,
                   usage and usage.completion_tokens, "")


def unique_prompt(length: int, salt: int) -> list[int]:
    """A prompt no load request shares a prefix with (see kvprobe.load.prompts)."""
    from kvprobe.load.prompts import unique_prompt as build

    return build(length, salt)
