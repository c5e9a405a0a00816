"""The body of the locustfile's completion request, serialised once: the JSON split around the two
token ids that vary per request (kvprobe.load.prompts), so a request costs two spliced integers,
not a P-token list serialised again."""

from __future__ import annotations

import importlib
import json

from kvprobe.load.prompts import ids_to_text, prompt_ids

# Placeholders for the two varying ids while the template is serialised: never a real token id.
SENTINELS = (-987654301, -987654302)


def _fallback_completion_body(prompt_ids, output_tokens, *, model=None, stream=True) -> dict:
    # For an engine whose dialect module has no completion_body (kvprobe/engines/<engine>.py).
    body = {"model": model, "prompt": list(prompt_ids), "max_tokens": output_tokens,
            "min_tokens": output_tokens, "ignore_eos": True, "stream": bool(stream)}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if model is None:
        del body["model"]
    return body


def completion_body_fn(engine: str):
    try:
        return importlib.import_module(f"kvprobe.engines.{engine}").completion_body
    except (ImportError, AttributeError):
        return _fallback_completion_body


def body_template(opts) -> list[bytes]:
    """The request body split around the first two token ids, which are the only ones that vary.

    Serialising a P-token list per request would cost ~P µs; splicing two ints costs ~1 µs.
    """
    p, base, rng = opts.kv_prompt_tokens, opts.kv_token_base, opts.kv_token_range
    k = opts.kv_shared_prefix_tokens
    ids = prompt_ids(p, SENTINELS, shared_prefix_tokens=k, seed=opts.kv_seed, base=base, rng=rng)
    make = completion_body_fn(opts.kv_engine)
    body = make(ids, opts.kv_output_tokens, model=opts.kv_model or None, stream=bool(opts.kv_stream))
    if getattr(opts, "kv_prompt_format", "ids") == "text":
        body["prompt"] = ids_to_text(body["prompt"])  # the sentinels stay spliceable inside their words
    text = json.dumps(body)
    parts = [text]
    for s in SENTINELS[: min(p - k, 2)]:
        head, sep, rest = parts[-1].partition(str(s))
        if not sep:
            raise RuntimeError("completion_body did not keep the prompt ids")
        parts[-1:] = [head, rest]
    return [x.encode() for x in parts]
