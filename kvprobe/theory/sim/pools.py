"""KV pools of the two engines, as the schedulers in `schedsim.py` see them, and the footprint of
one request in them (`FullAttention`; a model with other layer kinds adds a footprint per group).

vLLM's block pool (counts, prompt-block keys, runs of a request's own blocks) is in
`vllm_pool.py`; SGLang's pool is a slot count plus its radix tree (`SglangTokenPool`) at page
granularity, here.

Keys: a full prompt block's key is the chained hash of its token ids (`prompt_keys`). A block that
contains output tokens can only be hit by its own request (its hash chains through that request's
outputs), which the vLLM pool keeps as one run per request; so a resumed request hits its own
output blocks, while a *new* request whose prompt repeats another's outputs does not (not
modelled). Output token ids are a function of the rid and the position (`output_token`).
"""

from __future__ import annotations

import heapq
import zlib
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

from kvprobe.theory.model.sizes import cdiv
from kvprobe.theory.vllm.block_pool import VllmBlockPool  # noqa: F401 — imported from here by the schedulers

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


# --------------------------------------------------------------------------- SGLang


def _common_prefix(a: tuple, b: tuple) -> int:
    """Length of the common prefix of two token tuples (slice comparisons run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class OutputKey:
    """The key of a finished request's output leaf: hashable, equal only to itself, never a page."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name


class RadixNode:
    __slots__ = ("key", "size", "children", "parent", "lock", "stamp", "alive")

    def __init__(self, key, size: int, parent: RadixNode | None):
        self.key = key  # token ids (a tuple), or an opaque object for a leaf that nothing can match
        self.size = size
        self.children: dict = {}
        self.parent = parent
        self.lock = 0
        self.stamp = 0
        self.alive = True


class SglangTokenPool:
    """SGLang's token-slot allocator with its radix cache (mem_cache/, 0.5.23), reduced to sizes.

    The tree is SGLang's `RadixCache` at page granularity: a node holds a run of token ids (whole
    pages), children are keyed by their first page, a match stops at the first differing page and
    splits the node there (`_match_prefix_helper` / `_split_node`). A node locked by a running
    request (`inc_lock_ref`, up to the root) is protected; unlocked nodes are *evictable*, counted
    as free by admission (prefill_budget.py L91-97) and evicted least-recently-used leaf first
    when slots run out. A finished request's output tokens are one opaque leaf below its prompt:
    no other request can match them (their ids are the request's own).
    """

    def __init__(self, max_total_num_tokens: int, page_size: int):
        self.size = max_total_num_tokens
        self.ps = page_size
        self.available = max_total_num_tokens
        self.evictable = 0
        self.root = RadixNode((), 0, None)
        self.root.lock = 1
        self._clock = 0
        self._heap: list = []  # (stamp, serial, node): evictable leaves, stale entries skipped
        self._serial = 0

    @property
    def used(self) -> int:
        """sglang:num_used_tokens: slots held by requests (locked cache included)."""
        return self.size - self.available - self.evictable

    @property
    def token_usage(self) -> float:
        """sglang:token_usage = (M - available - evictable) / M, exported with 2 decimals."""
        return round(self.used / self.size, 2)

    def alloc(self, n: int) -> None:
        if n > self.available:
            self.evict(n - self.available)
        if n > self.available:
            raise RuntimeError(f"token pool over-allocated: need {n}, available {self.available}")
        self.available -= n

    def free(self, n: int) -> None:
        self.available += n

    # -- the tree
    def _touch(self, node: RadixNode) -> None:
        self._clock += 1
        while node is not None and node is not self.root:
            node.stamp = self._clock
            if node.lock == 0 and not node.children:
                self._push(node)
            node = node.parent

    def _push(self, node: RadixNode) -> None:
        self._serial += 1
        heapq.heappush(self._heap, (node.stamp, self._serial, node))

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut `node` after `at` tokens; the new upper node keeps the lock count (_split_node)."""
        upper = RadixNode(node.key[:at], at, node.parent)
        upper.lock, upper.stamp = node.lock, node.stamp
        node.parent.children[node.key[: self.ps]] = upper
        node.key, node.size, node.parent = node.key[at:], node.size - at, upper
        upper.children[node.key[: self.ps]] = node
        return upper

    def match(self, tokens: tuple, limit: int) -> tuple[RadixNode, int]:
        """Longest cached prefix of `tokens` within `limit` tokens, in whole pages."""
        ps, node, i = self.ps, self.root, 0
        limit = limit // ps * ps
        while i < limit:
            child = node.children.get(tokens[i : i + ps])
            if child is None or not isinstance(child.key, tuple):
                break
            n = min(child.size, limit - i)
            m = n if child.key[:n] == tokens[i : i + n] else _common_prefix(child.key[:n], tokens[i : i + n])
            m = m // ps * ps
            if m == 0:
                break
            if m < child.size:
                child = self._split(child, m)
            node, i = child, i + m
            if m < n:
                break
        self._touch(node)
        return node, i

    def evictable_on_path(self, node: RadixNode) -> int:
        """Evictable tokens a temporary lock of `node` would protect (add_one_req's _lock_node)."""
        total = 0
        while node is not self.root:
            if node.lock == 0:
                total += node.size
            node = node.parent
        return total

    def freed_by_unlock(self, node: RadixNode) -> int:
        """Tokens that become evictable if one holder of `node` unlocks it."""
        total = 0
        while node is not None and node is not self.root:
            if node.lock == 1:
                total += node.size
            node = node.parent
        return total

    def lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock == 0:
                self.evictable -= node.size
            node.lock += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        start = node
        while node is not self.root:
            node.lock -= 1
            if node.lock == 0:
                self.evictable += node.size
            node = node.parent
        if start is not self.root and start.lock == 0 and not start.children:
            self._push(start)

    def insert(self, tokens: tuple, node: RadixNode, depth: int) -> tuple[RadixNode, int]:
        """Insert the whole pages of `tokens` below `node` (which holds the first `depth` tokens).
        Returns the node holding the last page and how many of the new tokens were cached already
        (a twin prefilled them meanwhile: the caller frees its duplicate slots)."""
        ps = self.ps
        end = len(tokens) // ps * ps
        already = 0
        i = depth
        while i < end:
            child = node.children.get(tokens[i : i + ps])
            if child is None or not isinstance(child.key, tuple):
                new = RadixNode(tokens[i:end], end - i, node)
                node.children[tokens[i : i + ps]] = new
                self.evictable += new.size
                node, i = new, end
                break
            n = min(child.size, end - i)
            m = n if child.key[:n] == tokens[i : i + n] else _common_prefix(child.key[:n], tokens[i : i + n])
            m = m // ps * ps
            if m < child.size:
                child = self._split(child, m)
            node, i, already = child, i + m, already + m
        self._touch(node)
        return node, already

    def insert_leaf(self, parent: RadixNode, key, size: int) -> None:
        """An unlocked leaf of `size` private slots that no prompt can match (finished outputs)."""
        if size <= 0:
            return
        key = OutputKey(key)
        leaf = RadixNode(key, size, parent)
        parent.children[key] = leaf
        self.evictable += size
        self._touch(leaf)

    def evict(self, n: int) -> None:
        """Free at least n evictable tokens, least recently used leaf first (RadixCache.evict)."""
        freed = 0
        while freed < n and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if not node.alive or node.lock or node.children or stamp != node.stamp:
                continue
            node.alive = False
            parent = node.parent
            del parent.children[node.key[: self.ps] if isinstance(node.key, tuple) else node.key]
            self.evictable -= node.size
            self.available += node.size
            freed += node.size
            if parent is not self.root and parent.lock == 0 and not parent.children:
                self._push(parent)

    def check(self, private_held: int) -> None:
        """Leak check: used slots are requests' private slots plus locked tree nodes."""
        locked = evictable = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.lock:
                locked += node.size
            else:
                evictable += node.size
        if evictable != self.evictable or self.used != private_held + locked:
            raise AssertionError(
                f"token pool leak: {self.used} slots in use, requests hold {private_held} + {locked} locked; "
                f"evictable {self.evictable} counted, {evictable} in the tree")
