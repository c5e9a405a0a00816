"""The prompts of a probe, as token ids: what the load generator sends and `oneshot` sends.

A prompt of P tokens is: K ids shared by every request of the probe (`request.shared_prefix_tokens`,
a system prompt; a function of the probe's seed, so one probe's prefix never warms another's
cache), then the two ids that vary per request (the first of them unique for 30,000 requests:
from it on, no prefix cache can match another prompt of the probe), then filler. With K = 0
every prompt is unique from its first token. All ids lie in the load's id space
(`records.TOKEN_BASE` + [0, TOKEN_RANGE)), below every preset's vocabulary.

The theory simulates the same structure (`kvprobe.theory.schedsim.workload_prompt`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvprobe.load.records import TOKEN_BASE, TOKEN_RANGE


def varying_ids(k: int, base: int = TOKEN_BASE, rng: int = TOKEN_RANGE) -> tuple[int, int]:
    """Global request number k -> its two varying ids: the first unique for k < rng, the pair < rng²."""
    return base + k % rng, base + (k // rng) % rng


def shared_prefix(K: int, seed: int, base: int = TOKEN_BASE, rng: int = TOKEN_RANGE) -> list[int]:
    return [base + (seed * 104_729 + i * 7_919 + 5) % rng for i in range(K)]


def prompt_ids(prompt_tokens: int, varying: Sequence[int], *, shared_prefix_tokens: int = 0, seed: int = 0,
               base: int = TOKEN_BASE, rng: int = TOKEN_RANGE) -> list[int]:
    """The P ids of one prompt: the shared prefix, `varying` (as many as fit, at most two), filler.
    The load generator passes placeholders as `varying` to build its request template once."""
    K = shared_prefix_tokens
    if not 0 <= K < prompt_tokens:
        raise ValueError(f"shared_prefix_tokens must be in [0, {prompt_tokens}), got {K}")
    n = min(prompt_tokens - K, 2)
    filler = [base + (i * 7919 + 13) % rng for i in range(K + n, prompt_tokens)]
    return shared_prefix(K, seed, base, rng) + list(varying[:n]) + filler


def unique_prompt(length: int, salt: int) -> list[int]:
    """A prompt whose first token no load request uses (the load's first ids start at TOKEN_BASE),
    all inside the load's id space, so a real engine neither refuses them as out of vocabulary
    nor serves them from its prefix cache (a calibration or a length-limit request)."""
    first = 100 + salt % (TOKEN_BASE - 100)
    return [first] + [(first * 7 + i) % TOKEN_RANGE + 1 for i in range(1, length)]


TEXT_WORD_PREFIX = "t"


def ids_to_text(ids: Sequence[int]) -> str:
    """A prompt as text, one word per id ("t<id>"), for a front end that refuses token-id prompts
    (sglang-router 0.3.2: kvprobe/targets/fleet/router.py). The emulator reads one whitespace-separated
    word as one token (emulator/tokens.py), so P words stay exactly P tokens there, and distinct
    ids stay distinct words: the first word is as unique as the first id."""
    return " ".join(f"{TEXT_WORD_PREFIX}{i}" for i in ids)


def as_prompt_format(body: dict, prompt_format: str) -> dict:
    """A request body as a target takes it: with prompt_format "text" (behind sglang-router), the
    token-id prompt as text."""
    if prompt_format == "text" and isinstance(body.get("prompt"), list):
        return {**body, "prompt": ids_to_text(body["prompt"])}
    return body
