"""A closed loop of real HTTP requests for the checks a kvprobe profile cannot express (requests
without ignore_eos): each user sends its next request when the last one ends; bounded in requests
and in time; 127.0.0.1 only."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from kvprobe.engines import sglang as dialect


@dataclass
class LoopResult:
    completion_tokens: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def plain_body(prompt_ids: list[int], output_tokens: int, model: str) -> dict:
    """max_tokens only: no ignore_eos, no min_tokens, so SGLang reserves with new_token_ratio
    (sglang.md §2.2). The shadow's pseudo tokens are never EOS, so each request still runs to O."""
    return {"model": model, "prompt": prompt_ids, "max_tokens": output_tokens, "stream": False}


def closed_loop(url: str, *, model: str, users: int, prompt_tokens: int, output_tokens: int,
                seconds: float, max_requests: int, stop_when=None) -> LoopResult:
    """Run `users` closed-loop clients for at most `seconds` and `max_requests` requests in all;
    `stop_when()` (polled) ends the loop early once what the caller waits for has happened."""
    out = LoopResult()
    lock = threading.Lock()
    sent = [0]
    end = time.monotonic() + seconds
    stop = threading.Event()

    def user(u: int) -> None:
        k = 0
        while not stop.is_set() and time.monotonic() < end:
            with lock:
                if sent[0] >= max_requests:
                    return
                sent[0] += 1
            # unique from the first token: no prefix-cache hits between requests
            ids = [1000 + (u * 997 + k * 7919 + i * 31) % 60000 for i in range(prompt_tokens)]
            ids[0] = 61000 + (u * 1009 + k) % 60000
            body = json.dumps(plain_body(ids, output_tokens, model)).encode()
            req = urllib.request.Request(url + dialect.COMPLETIONS_PATH, data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=max(5.0, end - time.monotonic() + 60)) as resp:
                    usage = json.loads(resp.read())["usage"]
                with lock:
                    out.completion_tokens.append(int(usage["completion_tokens"]))
            except (urllib.error.URLError, OSError, KeyError, ValueError) as err:
                with lock:
                    out.errors.append(f"{type(err).__name__}: {err}")
            k += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=user, args=(u,), daemon=True) for u in range(users)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and time.monotonic() < end:
        if stop_when is not None and stop_when():
            stop.set()
            break
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout=max(1.0, end - time.monotonic() + 90))
    out.seconds = time.monotonic() - t0
    return out
