"""SGLang's KV pool as its scheduler sees it: a count of token slots and the radix tree that caches
prompts in them, at page granularity. Named after SGLang's own
python/sglang/srt/mem_cache/radix_cache.py, which it follows."""

from __future__ import annotations

import heapq


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
