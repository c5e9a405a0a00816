"""KV pools of the two engines, as the schedulers in `schedsim.py` see them.

Blocks (vLLM) and cache units (SGLang) that carry no prefix hash are *anonymous*: only their
count is kept, so a decode that crosses a block boundary costs an integer update, not an object.
A block gets a key (its chained prefix hash) only when prefix caching needs one: full prompt
blocks when they are scheduled, full output blocks when the request frees them (the only moment
another request could hit them: a preempted request resuming, a later turn of a conversation).

Keys: a full prompt block's key is the chained hash of its token ids (`prompt_keys`); a block that
contains output tokens is keyed by `("o", rid, index)`, exact because the scheduler derives output
token ids from the rid and the position (`output_token`). So a resumed request hits its own output
blocks, while a *new* request whose prompt repeats another's outputs does not (not modelled).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence

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


class SglangTokenPool:
    """SGLang token-slot allocator plus a radix-like prefix cache (mem_cache/, 0.5.23).

    The radix tree is modelled at `unit` granularity (page_size, or 16 tokens when page_size is 1):
    a shared prompt matches in whole units, slightly less than the real token-level match.
    Cached units not locked by a running request are *evictable*; admission counts them as free
    (prefill_budget.py L91-97) and allocation evicts them LRU (leaf first) when slots run out.
    """

    def __init__(self, max_total_num_tokens: int, unit: int):
        self.size = max_total_num_tokens
        self.unit = unit
        self.available = max_total_num_tokens
        self.units: dict[object, list[int]] = {}  # key -> [tokens, lock_ref]
        self.lru: OrderedDict[object, int] = OrderedDict()  # unlocked units, head evicted first
        self.evictable = 0

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

    def evict(self, n: int) -> None:
        freed = 0
        while freed < n and self.lru:
            key, size = self.lru.popitem(last=False)
            del self.units[key]
            self.evictable -= size
            self.available += size
            freed += size

    def match(self, keys: Sequence) -> list:
        hit = []
        for key in keys:
            if key not in self.units:
                break
            hit.append(key)
        return hit

    def evictable_in(self, keys: Sequence) -> int:
        return sum(self.lru.get(key, 0) for key in keys)

    def lock(self, keys: Sequence) -> None:
        for key in keys:
            entry = self.units[key]
            if entry[1] == 0:
                self.evictable -= self.lru.pop(key)
            entry[1] += 1

    def unlock(self, keys: Sequence) -> None:
        for key in reversed(keys):
            entry = self.units[key]
            entry[1] -= 1
            if entry[1] == 0:
                self.lru[key] = entry[0]
                self.evictable += entry[0]

    def insert(self, key, size: int, *, locked: bool) -> bool:
        """Hand `size` private slots to the cache under `key`. False if the key is cached already:
        the caller then frees its duplicate slots."""
        if key in self.units:
            return False
        self.units[key] = [size, 1 if locked else 0]
        if not locked:
            self.lru[key] = size
            self.evictable += size
        return True

    def check(self, private_held: int) -> None:
        """Leak check: used slots are requests' private slots plus locked cache units."""
        locked = sum(size for size, lock in self.units.values() if lock)
        if self.used != private_held + locked:
            raise AssertionError(
                f"token pool leak: {self.used} slots in use, requests hold {private_held} + {locked} locked")
