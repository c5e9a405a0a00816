"""vLLM 0.33's block pool as the simulated scheduler sees it: counts, prompt-block keys, and runs.

A request's blocks are of three kinds here:

- *anonymous*: no prefix hash (a partly filled block, or prefix caching off). Only their count is
  kept, so a decode that crosses a block boundary costs an integer update.
- *prompt blocks*: full blocks of the prompt, keyed by their chained hash (`pools.prompt_keys`),
  so requests with a common prompt prefix share them, one key per block.
- *own blocks*: full blocks that contain output tokens. vLLM hashes them too (their hash chains
  through the request's own outputs, kv_cache_utils.py), so only the same request can ever hit
  them: on resuming after a preemption. They are kept as a `Run` — one entry for a contiguous
  range of block indices — so preempting a request that holds thousands of blocks, looking up
  its resume and evicting its blocks cost O(1), not O(blocks).

The free queue (`lru`) holds entries in eviction order: a prompt key (1 block) or a run (n
blocks). vLLM frees a request's blocks in reverse (`free` in single_type_kv_cache_manager: the
last block is evicted first), so a run loses its highest blocks first and what remains of it is
always the range [lo, lo + count).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class Run:
    """One free-queue entry for `count` consecutive hashed blocks (its count is the entry's value
    in `VllmBlockPool.lru`). `lo` is the index of its first block in its request's block table;
    a run whose request can never hit it again (finished, or output blocks beyond a prefix that
    was already cached) has no owner and is only evicted."""

    __slots__ = ("lo",)

    def __init__(self, lo: int = -1):
        self.lo = lo


class VllmBlockPool:
    """vLLM 0.33 `BlockPool` (v1/core/block_pool.py) reduced to counts, keys and runs.

    The free queue is [anonymous blocks][hashed blocks in LRU order]: freed unhashed blocks go to
    the head, freed hashed blocks to the tail (`free_blocks` L816-849), and allocation pops the
    head, so anonymous blocks are used first and cached ones are evicted oldest first.
    Block 0 is the reserved null block: usable = num_gpu_blocks - 1.
    """

    def __init__(self, num_gpu_blocks: int):
        self.num_gpu_blocks = num_gpu_blocks
        self.usable = num_gpu_blocks - 1
        self.free_anon = self.usable
        # cached blocks with ref_cnt 0, head evicted first; value = blocks in the entry
        self.lru: OrderedDict[object, int] = OrderedDict()
        self.lru_blocks = 0
        self.refs: dict[object, int] = {}  # prompt keys with ref_cnt > 0
        self.own_held = 0  # own blocks (see module doc) held by running requests, ref_cnt 1 each
        # changes whenever a key or run is cached: a waiting request's prefix hits can only grow then
        self.added = 0

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
        if n > self.free_anon + self.lru_blocks:
            raise RuntimeError(f"block pool over-allocated: need {n}, free {self.num_free}")
        if n <= self.free_anon:
            self.free_anon -= n
            return
        left = n - self.free_anon
        self.free_anon = 0
        self.lru_blocks -= left
        lru = self.lru
        while left:
            key, count = lru.popitem(last=False)
            if count > left:  # part of a run: its lower blocks stay at the head
                lru[key] = count - left
                lru.move_to_end(key, last=False)
                break
            left -= count

    # -- prompt keys
    def prompt_hits(self, keys: Sequence, limit: int) -> tuple[int, int]:
        """How many of the first `limit` keys are cached, counting from the first (a prefix), and
        how many of those are free (ref_cnt 0, in the free queue)."""
        refs, lru = self.refs, self.lru
        if not keys or limit <= 0 or (keys[0] not in refs and keys[0] not in lru):
            return 0, 0
        part = keys[:limit]
        if all(map(lru.__contains__, part)):  # a preempted request's own prompt: all free (in C)
            return len(part), len(part)
        n = free = 0
        for key in part:
            if key in lru:
                free += 1
            elif key not in refs:
                break
            n += 1
        return n, free

    def touch(self, keys: Sequence) -> None:
        """A prefix hit: ref_cnt += 1; a ref_cnt-0 block leaves the free queue (`touch` L792-810)."""
        refs, lru = self.refs, self.lru
        if lru.keys().isdisjoint(keys):  # all held by running requests: one C loop
            for key in keys:
                refs[key] += 1
            return
        for key in keys:
            if key in lru:
                del lru[key]
                self.lru_blocks -= 1
                refs[key] = 1
            else:
                refs[key] += 1

    def cache_keys(self, keys: Sequence, start: int, stop: int) -> int:
        """Give the caller's anonymous blocks start..stop-1 the keys keys[start:stop], up to the first
        key already cached by another block (that block and the ones after it stay anonymous).
        Returns the index reached."""
        refs, lru = self.refs, self.lru
        part = keys[start:stop]
        if refs.keys().isdisjoint(part) and lru.keys().isdisjoint(part):  # the usual case, in C
            refs.update(dict.fromkeys(part, 1))
            n = start + len(part)
        else:
            n = start
            for key in part:
                if key in refs or key in lru:
                    break
                refs[key] = 1
                n += 1
        if n > start:
            self.added += 1
        return n

    # -- own runs
    def own_cached(self, runs: list[Run], lo: int) -> int:
        """Blocks cached from index `lo` on, walking the request's runs (usually one)."""
        lru, pos = self.lru, lo
        found = True
        while found:
            found = False
            for run in runs:
                if run.lo == pos and run in lru:
                    pos += lru[run]
                    found = True
        return pos - lo

    def touch_own(self, runs: list[Run], lo: int, n: int) -> list[Run]:
        """A hit on a request's own blocks lo..lo+n-1: they leave the free queue; the part of a run
        above the hit stays where it is. Returns the runs still in the free queue."""
        lru, pos, end = self.lru, lo, lo + n
        while pos < end:
            run = next(r for r in runs if r.lo == pos and r in lru)
            count = lru[run]
            used = min(count, end - pos)
            if used == count:
                del lru[run]
            else:  # the rest stays at its place in the queue, starting higher
                lru[run] = count - used
                run.lo = pos + used
            pos += used
        self.lru_blocks -= n
        self.own_held += n
        return [r for r in runs if r in lru]

    def own_limit(self, runs: list[Run], start: int, stop: int) -> int:
        """Own blocks start..stop-1 get their hashes up to the first one still cached from before
        (a run left in the free queue); as `cache_keys`. Returns the index reached."""
        lru = self.lru
        end = min([stop] + [r.lo for r in runs if r in lru and r.lo >= start])
        if end > start:
            self.added += 1
        return max(end, start)

    # -- freeing
    def release(self, keys: Sequence, anon: int, *, dead: int = 0, own: int = 0, own_lo: int = 0,
                held_own: int = 0, owned: bool = False) -> Run | None:
        """Free a request's blocks in vLLM's order (kv_cache_manager `free`: reversed, so the last
        block is evicted first): `dead` hashed blocks no one can hit, then its `own` blocks
        own_lo..own_lo+own-1 as one run (the first `held_own` of them it held from a hit; the run
        is returned when `owned`: the request can hit it on resume), then its prompt keys, highest
        first, each when its ref_cnt reaches 0; its `anon` anonymous blocks to the head."""
        lru = self.lru
        if dead:
            lru[Run()] = dead
        run = None
        if own:
            run = Run(own_lo if owned else -1)
            lru[run] = own
        self.lru_blocks += dead + own
        self.own_held -= held_own
        refs = self.refs
        order = keys[::-1]
        if all(map((1).__eq__, map(refs.__getitem__, order))):  # no one else holds them: in C
            lru.update(dict.fromkeys(order, 1))
            list(map(refs.pop, order))
            self.lru_blocks += len(order)
        else:
            for key in order:
                left = refs[key] - 1
                if left:
                    refs[key] = left
                else:
                    del refs[key]
                    lru[key] = 1
                    self.lru_blocks += 1
        self.free_anon += anon
        return run if owned else None

    def check(self, anon_held: int) -> None:
        """Leak check: every block in use is a referenced prompt block, an own block some request
        holds, or an anonymous block some request holds (`anon_held` is their sum over requests)."""
        in_use = self.usable - self.num_free
        if in_use != anon_held + len(self.refs) + self.own_held:
            raise AssertionError(
                f"block pool leak: {in_use} blocks in use, requests hold {anon_held} anonymous + "
                f"{len(self.refs)} prompt + {self.own_held} own cached")
        if self.lru_blocks != sum(self.lru.values()):
            raise AssertionError(f"free queue miscounted: {self.lru_blocks} != {sum(self.lru.values())}")
