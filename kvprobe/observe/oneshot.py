"""Single requests the probe sends itself, outside the load: calibration and the length-limit check.

Plain urllib in the probe's own process: no gevent here (Locust runs in its own subprocess).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


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
    streaming bodies are read line by line."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        url.rstrip("/") + path,
        data=data,
        headers={"Content-Type": "application/json", "Accept-Encoding": "identity", **(headers or {})},
        method="POST",
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return _read_success(resp, t0, streaming=bool(body.get("stream")))
    except urllib.error.HTTPError as err:
        text = err.read().decode(errors="replace")
        return OneShot(err.code, time.monotonic() - t0, None, None, None, text)
    except (urllib.error.URLError, OSError) as err:
        return OneShot(0, time.monotonic() - t0, None, None, None, f"{type(err).__name__}: {err}")


def _read_success(resp, t0: float, *, streaming: bool) -> OneShot:
    if not streaming:
        payload = json.loads(resp.read())
        usage = payload.get("usage") or {}
        return OneShot(200, time.monotonic() - t0, None, usage.get("prompt_tokens"), usage.get("completion_tokens"), "")
    ttft = None
    usage: dict = {}
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            return OneShot(400, time.monotonic() - t0, ttft, None, None, data.decode())
        if ttft is None and any(c.get("text") for c in chunk.get("choices") or []):
            ttft = time.monotonic() - t0
        if chunk.get("usage"):
            usage = chunk["usage"]
    return OneShot(200, time.monotonic() - t0, ttft, usage.get("prompt_tokens"), usage.get("completion_tokens"), "")


def unique_prompt(length: int, salt: int) -> list[int]:
    """A prompt no load request shares a prefix with (see kvprobe.load.prompts)."""
    from kvprobe.load.prompts import unique_prompt as build

    return build(length, salt)
