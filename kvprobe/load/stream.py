"""Reading one streamed completion cheaply: only the lines up to the first content chunk are parsed;
the rest of the stream is read in bulk (`read(64 KiB)` returns at the end of the message) keeping an
8 KiB tail in which the usage chunk is found with one regex. This is what lets one Locust process
hold several hundred streams.

The stream is geventhttpclient's response (`resp.stream` of Locust's FastHttpUser,
locust/contrib/fasthttp.py): its `readline` on a newline returns each SSE line as it arrives, whereas
`FastResponse.readline()` splits on CRLF and `iter_content` waits for whole 1 KiB chunks. Reading to
the end of the message lets geventhttpclient keep the connection (it closes one whose message is not
complete).
"""

from __future__ import annotations

import json
import re
import time

from kvprobe.load.records import Record

BULK = 1 << 16
TAIL = 8192
_USAGE_RE = re.compile(rb'"usage"\s*:\s*\{')


def _is_content(payload: bytes) -> bool | None:
    """True for a chunk carrying a choice, None for an error object, False otherwise (usage-only)."""
    try:
        obj = json.loads(payload)
    except ValueError:
        return False
    if isinstance(obj, dict):
        if obj.get("choices"):
            return True
        if "error" in obj:
            return None
    return False


def usage_from_tail(tail: bytes) -> dict | None:
    matches = list(_USAGE_RE.finditer(tail))
    if not matches:
        return None
    last = matches[-1]
    start = tail.rfind(b"data:", 0, last.start())
    end = tail.find(b"\n", last.start())
    try:
        obj = json.loads(tail[start + 5 if start >= 0 else 0: end if end >= 0 else len(tail)])
        usage = obj.get("usage")
        return usage if isinstance(usage, dict) else None
    except ValueError:
        return None


def read_stream(stream, rec: Record | None = None) -> tuple[float | None, bytes]:
    """Time the first content chunk, then drain the message in bulk; returns (t_first, tail).

    The first-token time goes into `rec` the moment the chunk arrives, not when the stream ends:
    a stream cut by a ramp-down or the end of the load (GreenletExit inside the bulk read) is
    recorded as aborted *with* its first token, so it counts as running until it was cut.
    """
    t_first = None
    tail = b""
    while True:
        line = stream.readline(b"\n")
        if not line:
            return None, tail
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload == b"[DONE]":
                tail += line
                break
            c = _is_content(payload)
            if c:
                t_first = time.time()
                if rec is not None:
                    rec.t_first = t_first
                tail = line
                break
            tail = (tail + line)[-TAIL:]
            if c is None:
                break
    while True:
        data = stream.read(BULK)
        if not data:
            return t_first, tail
        tail = (tail + data)[-TAIL:]
