"""The body of the locustfile's completion request, serialised once: the JSON split around the two
token ids that vary per request (kvprobe.load.prompts), so a request costs two spliced integers,
not a P-token list serialised again."""

from __future__ import annotations

import json

from kvprobe.engines import get_dialect
from kvprobe.load.prompts import ids_to_text, prompt_ids

# Placeholders for the two varying ids while the template is serialised: never a real token id.
SENTINELS = (-987654301, -987654302)


def completion_body_fn(engine: str):
    return get_dialect(engine).completion_body


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
