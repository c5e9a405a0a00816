"""Tokens without a tokenizer: the emulator's deterministic text rule and its output tokens.

Text prompts: split on whitespace; each word becomes one token id, `VOCAB_BASE + blake2b(word) %
VOCAB_SPAN`. The same text gives the same ids in every process (no `hash()` randomisation), so
shared text prefixes hit the prefix cache like shared token-id prefixes do. Output tokens are the ids
schedsim emits; their text is `" t<id>"`, so a completion's text has one word per output token.
"""

from __future__ import annotations

import hashlib
import random

VOCAB_BASE = 100
VOCAB_SPAN = 32000
EOS_TOKEN_ID = 2  # the id reported as matched for a pseudo-EOS stop


def text_to_ids(text: str) -> list[int]:
    return [VOCAB_BASE + int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "big") % VOCAB_SPAN
            for w in text.split()]


def token_text(token_id: int) -> str:
    return f" t{token_id}"


def pseudo_eos(seed: int, serial: int, min_tokens: int, max_tokens: int, ignore_eos: bool) -> int | None:
    """Where a request without ignore_eos stops early: seeded per request (seed, arrival serial); half
    of them run to max_tokens. Never before min_tokens (the engines gate EOS on min_tokens)."""
    if ignore_eos or max_tokens <= 1:
        return None
    rng = random.Random(seed * 1_000_003 + serial)
    if rng.random() < 0.5:
        return None
    lo = max(1, min_tokens)
    return rng.randint(lo, max_tokens) if lo < max_tokens else None
