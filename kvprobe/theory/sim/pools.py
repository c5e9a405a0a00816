"""The footprint of one request in an engine's KV pool, as the schedulers in `schedsim.py` see it
(`FullAttention`; a model with other layer kinds adds a footprint per group), and the token ids
both engines' pools key their blocks by.

The pools themselves are the engines': vLLM's block pool (counts, prompt-block keys, runs of a
request's own blocks) is `kvprobe.theory.vllm.block_pool`; SGLang's token pool and radix tree
`kvprobe.theory.sglang.radix_cache`.

Keys: a full prompt block's key is the chained hash of its token ids (`prompt_keys`). A block that
contains output tokens can only be hit by its own request (its hash chains through that request's
outputs), which the vLLM pool keeps as one run per request; so a resumed request hits its own
output blocks, while a *new* request whose prompt repeats another's outputs does not (not
modelled). Output token ids are a function of the rid and the position (`output_token`).
"""

from __future__ import annotations

import zlib
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

from kvprobe.theory.model.sizes import cdiv

VOCAB = 32000


def rid_seed(rid: str) -> int:
    """Stable across processes (str hash() is randomised per process)."""
    return zlib.crc32(rid.encode())


def output_token(seed: int, index: int) -> int:
    """Deterministic output token id number `index` (0-based) of the request with this seed."""
    return (seed * 2654435761 + index * 40503 + 17) % VOCAB


def prompt_keys(prompt: Sequence[int], unit: int) -> list[int]:
    """Chained hashes of the full `unit`-token blocks of a prompt (vLLM hashes blocks the same way:
    each block's hash covers its parent's hash and its own token ids, v1/core/kv_cache_utils.py)."""
    keys, parent = [], 0
    for block in zip(*[iter(prompt)] * unit, strict=False):  # full blocks only, as tuples made in C
        parent = hash((parent, block))
        keys.append(parent)
    return keys


# --------------------------------------------------------------------------- request footprint


class FullAttention:
    """What one request holds in a full-attention KV group: every computed token, in blocks (pages)
    of `block_size`. The schedulers ask a footprint, never `cdiv` directly, so a model with several
    layer kinds (a sliding-window or linear-attention group beside this one) adds a footprint per
    group and sums them, without touching the admission policies.

    `allocs(held_tokens, s)`, `allocs_sum(held_tokens, k)` and `steps_within` are the closed forms
    behind the event-driven fast path: with every request decoding one token per step, the blocks
    allocated in steps 1..s, their sum over s = 1..k (for the time-averaged usage), and how many
    steps fit in the free blocks. `phases(held_tokens)` computes what they share once."""

    def __init__(self, block_size: int):
        self.B = block_size

    def blocks(self, tokens):
        return cdiv(tokens, self.B)

    def phases(self, tokens: np.ndarray) -> Phases:
        return Phases.of(tokens, self.B)

    def allocs(self, tokens: np.ndarray, s: int) -> int:
        """Blocks taken by requests holding `tokens` computed tokens after each computes s more."""
        return int((self.blocks(tokens + s) - self.blocks(tokens)).sum())

    def allocs_sum(self, tokens: np.ndarray, k: int) -> int:
        """sum_{s=1..k} allocs(tokens, s)."""
        return self.phases(tokens).allocs_sum(k)

    def steps_within(self, tokens: np.ndarray, free: int, k_max: int) -> int:
        """The largest k <= k_max with allocs(tokens, k) <= free (allocations only grow)."""
        return self.phases(tokens).steps_within(free, k_max)


class Phases:
    """Where each of n requests stands against its next block boundary, for closed forms over
    steps in which every one of them computes one token. A request holding t tokens takes a block
    at steps f, f + B, f + 2B, ... with f = (-t mod B) + 1 in 1..B; so after s = qB + m steps
    (0 <= m < B) the n requests took allocs(s) = n*q + c[m] blocks, c[m] = #{f <= m}."""

    __slots__ = ("n", "B", "c", "_c2")

    def __init__(self, n: int, B: int, c: list[int]):
        self.n, self.B, self.c, self._c2 = n, B, c, None

    @classmethod
    def of(cls, tokens: np.ndarray, B: int) -> Phases:
        counts = np.bincount(-tokens % B + 1, minlength=B + 1)[:B]  # [f] = requests with that f
        return cls(len(tokens), B, counts.cumsum().tolist())

    @classmethod
    def of_residues(cls, hist: list[int], shift: int, n: int) -> Phases:
        """From hist[r] = requests holding t = r (mod B), after each computed `shift` more tokens."""
        B = len(hist)
        s = shift % B
        rot = hist[-s:] + hist[:-s] if s else hist  # rot[x] = requests now holding t = x (mod B)
        # t = 0 takes its next block at f = 1, t = x > 0 at f = B - x + 1
        return cls(n, B, [0, *accumulate([rot[0], *rot[:0:-1]][: B - 1])])

    def allocs(self, s: int) -> int:
        q, m = divmod(s, self.B)
        return self.n * q + self.c[m]

    def allocs_sum(self, k: int) -> int:
        """sum_{s=1..k} allocs(s): with k = QB + R, sum floor(s/B) = B Q(Q-1)/2 + Q(R+1) and
        sum c[s mod B] = Q (c[0] + ... + c[B-1]) + c[0] + ... + c[R] (c[0] = 0)."""
        B = self.B
        if self._c2 is None:
            self._c2 = list(accumulate(self.c))
        Q, R = divmod(k, B)
        return self.n * (B * Q * (Q - 1) // 2 + Q * (R + 1)) + Q * self._c2[B - 1] + self._c2[R]

    def steps_within(self, free: int, k_max: int) -> int:
        """The largest k <= k_max with allocs(k) <= free: q = free // n whole rounds of B steps,
        then the longest part of a round whose first-timers fit in the rest."""
        if k_max <= 0 or not self.n:
            return max(k_max, 0)
        q, rem = divmod(free, self.n)
        if q * self.B >= k_max:
            return k_max
        return min(q * self.B + bisect_right(self.c, rem) - 1, k_max)
