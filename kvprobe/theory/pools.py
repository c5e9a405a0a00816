"""KV pools of the two engines, as the schedulers in `schedsim.py` see them, and the footprint of
one request in them (`FullAttention`; a model with other layer kinds adds a footprint per group).

vLLM blocks that carry no prefix hash are *anonymous*: only their count is kept, so a decode that
crosses a block boundary costs an integer update, not an object. SGLang's pool is a slot count
plus its radix tree (`SglangTokenPool`) at page granularity.
A block gets a key (its chained prefix hash) only when prefix caching needs one: full prompt
blocks when they are scheduled, full output blocks when the request frees them (the only moment
another request could hit them: a preempted request resuming, a later turn of a conversation).

Keys: a full prompt block's key is the chained hash of its token ids (`prompt_keys`); a block that
contains output tokens is keyed by `("o", rid, index)`, exact because the scheduler derives output
token ids from the rid and the position (`output_token`). So a resumed request hits its own output
blocks, while a *new* request whose prompt repeats another's outputs does not (not modelled).
"""

from __future__ import annotations

import heapq
import zlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

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
    for start in range(0, len(prompt) - unit + 1, unit):
        parent = hash((parent, tuple(prompt[start:start + unit])))
        keys.append(parent)
    return keys


class VllmBlockPool:
    """vLLM 0.33 `BlockPool` (v1/core/block_pool.py) reduced to counts and keys.

    The free queue is [anonymous blocks][hashed blocks in LRU order]: freed unhashed blocks go to
    the head, freed hashed blocks to the tail (`free_blocks` L816-849), and allocation pops the
    head, so anonymous blocks are used first and cached ones are evicted oldest first.
    Block 0 is the reserved null block: usable = num_gpu_blocks - 1.
    """

    def __init__(self, num_gpu_blocks: int):
        self.num_gpu_blocks = num_gpu_blocks
        self.usable = num_gpu_blocks - 1
        self.free_anon = self.usable
        # cached blocks with ref_cnt 0, head evicted first; value = blocks in the entry: 1 for a
        # hashed block, more for a "dead run" (hashed blocks no request can ever hit again: the
        # output blocks of a finished request), kept as one entry so freeing them is O(1)
        self.lru: OrderedDict[object, int] = OrderedDict()
        self.lru_blocks = 0
        self.refs: dict[object, int] = {}  # cached, ref_cnt > 0
        self._runs = 0
        self.added = 0  # keys ever cached: a waiting request's prefix hits can only grow when it moves

    @property
    def num_free(self) -> int:
        """`get_num_free_blocks`: includes cached-but-unreferenced blocks (evictable)."""
        return self.free_anon + self.lru_blocks

    @property
    def usage(self) -> float:
        """`get_usage` (block_pool.py L921-932), exported as vllm:kv_cache_usage_perc."""
        return 1.0 - self.num_free / self.usable if self.usable else 0.0

    def is_cached(self, key) -> bool:
        return key in self.refs or key in self.lru

    def take(self, n: int) -> None:
        """Allocate n new (anonymous) blocks from the head of the free queue, evicting if needed."""
        if n > self.num_free:
            raise RuntimeError(f"block pool over-allocated: need {n}, free {self.num_free}")
        from_anon = min(n, self.free_anon)
        self.free_anon -= from_anon
        left = n - from_anon
        self.lru_blocks -= left
        while left:
            key, count = self.lru.popitem(last=False)
            if count > left:  # part of a dead run: the rest stays at the head
                self.lru[key] = count - left
                self.lru.move_to_end(key, last=False)
                break
            left -= count

    def touch(self, keys: Sequence) -> None:
        """A prefix hit: ref_cnt += 1; a ref_cnt-0 block leaves the free queue (`touch` L792-810)."""
        for key in keys:
            if key in self.lru:
                del self.lru[key]
                self.lru_blocks -= 1
                self.refs[key] = 1
            else:
                self.refs[key] += 1

    def cache(self, key) -> bool:
        """Give one of the caller's anonymous blocks this key. False if the key is already cached
        by another block (the caller's block then stays anonymous)."""
        if self.is_cached(key):
            return False
        self.refs[key] = 1
        self.added += 1
        return True

    def release(self, keys: Sequence, anon: int, dead: int = 0) -> None:
        """Free a request's blocks: hashed blocks in reverse order to the tail (the last block is
        evicted first, kv_cache_manager `free` uses reversed order), anonymous ones to the head.
        `dead` full blocks that follow `keys` go to the tail first, as one run."""
        if dead:
            self._runs += 1
            self.lru[("dead", self._runs)] = dead
            self.lru_blocks += dead
        for key in reversed(keys):
            left = self.refs[key] - 1
            if left:
                self.refs[key] = left
            else:
                del self.refs[key]
                self.lru[key] = 1
                self.lru_blocks += 1
        self.free_anon += anon

    def check(self, anon_held: int) -> None:
        """Leak check: every block in use is a referenced cached block or an anonymous block some
        request holds (`anon_held` is their sum over requests)."""
        in_use = self.usable - self.num_free
        if in_use != anon_held + len(self.refs):
            raise AssertionError(
                f"block pool leak: {in_use} blocks in use, requests hold {anon_held} + {len(self.refs)} cached")


# --------------------------------------------------------------------------- request footprint


class FullAttention:
    """What one request holds in a full-attention KV group: every computed token, in blocks (pages)
    of `block_size`. The schedulers ask a footprint, never `cdiv` directly, so a model with several
    layer kinds (a sliding-window or linear-attention group beside this one) adds a footprint per
    group and sums them, without touching the admission policies.

    `allocs(held_tokens, s)` and `allocs_sum(held_tokens, k)` are the closed forms behind the
    event-driven fast path: with every request decoding one token per step, the blocks allocated
    in steps 1..s, and their sum over s = 1..k (for the time-averaged usage)."""

    def __init__(self, block_size: int):
        self.B = block_size

    def blocks(self, tokens):
        return -(-tokens // self.B)

    def _prefix(self, n: np.ndarray) -> np.ndarray:
        """F(n) = sum_{t=1..n} ceil(t/B), exactly, in int64."""
        q, r = np.divmod(n, self.B)
        return self.B * q * (q + 1) // 2 + r * (q + 1)

    def allocs(self, tokens: np.ndarray, s: int) -> int:
        """Blocks taken by requests holding `tokens` computed tokens after each computes s more."""
        return int((self.blocks(tokens + s) - self.blocks(tokens)).sum())

    def allocs_sum(self, tokens: np.ndarray, k: int) -> int:
        """sum_{s=1..k} allocs(tokens, s)."""
        return int((self._prefix(tokens + k) - self._prefix(tokens) - k * self.blocks(tokens)).sum())

    def steps_within(self, tokens: np.ndarray, free: int, k_max: int) -> int:
        """The largest k <= k_max with allocs(tokens, k) <= free (allocations only grow)."""
        if k_max <= 0 or self.allocs(tokens, k_max) <= free:
            return max(k_max, 0)
        lo, hi = 0, k_max  # allocs(lo) <= free < allocs(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.allocs(tokens, mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo


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
