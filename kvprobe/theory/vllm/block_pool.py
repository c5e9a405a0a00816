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

The free queue (`lru`) holds entries in eviction order, each standing for several blocks freed
together: a `Run` of own blocks, or a `KeyRun` of prompt keys. vLLM frees a request's blocks in
reverse (`free` in single_type_kv_cache_manager: the last block is evicted first), so an entry
loses its highest blocks first. A request holds a prefix of its prompt keys, so the keys whose
ref_cnt falls to 0 when it leaves are consecutive in its prompt, and a later hit (a prefix of
someone's prompt) takes the lowest of them first: what remains of a `KeyRun` is always a slice.
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


class KeyRun:
    """Prompt keys freed together, in eviction order (highest block first): keys[start:end] are
    still in the free queue; eviction advances `start`, a hit takes keys from `end`."""

    __slots__ = ("keys", "start", "end")

    def __init__(self, keys: list):
        self.keys, self.start, self.end = keys, 0, len(keys)


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
        self.free_keys: dict[object, KeyRun] = {}  # prompt keys with ref_cnt 0: their entry
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
        return key in self.refs or key in self.free_keys

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
        lru, free_keys = self.lru, self.free_keys
        while left:
            entry, count = lru.popitem(last=False)
            if count > left:  # part of an entry: its lower blocks stay at the head
                lru[entry] = count - left
                lru.move_to_end(entry, last=False)
                if type(entry) is KeyRun:
                    list(map(free_keys.pop, entry.keys[entry.start : entry.start + left]))
                    entry.start += left
                break
            if type(entry) is KeyRun:
                list(map(free_keys.pop, entry.keys[entry.start : entry.end]))
            left -= count

    # -- prompt keys
    def prompt_hits(self, keys: Sequence, limit: int) -> tuple[int, int]:
        """How many of the first `limit` keys are cached, counting from the first (a prefix), and
        how many of those are free (ref_cnt 0, in the free queue)."""
        refs, free_keys = self.refs, self.free_keys
        if not keys or limit <= 0 or (keys[0] not in refs and keys[0] not in free_keys):
            return 0, 0
        part = keys[:limit]
        if all(map(free_keys.__contains__, part)):  # a preempted request's own prompt: all free (in C)
            return len(part), len(part)
        n = free = 0
        for key in part:
            if key in free_keys:
                free += 1
            elif key not in refs:
                break
            n += 1
        return n, free

    def touch(self, keys: Sequence) -> None:
        """A prefix hit: ref_cnt += 1; a ref_cnt-0 block leaves the free queue (`touch` L792-810)."""
        refs, free_keys, lru = self.refs, self.free_keys, self.lru
        if free_keys.keys().isdisjoint(keys):  # all held by running requests
            for key in keys:
                refs[key] += 1
            return
        for key in keys:  # in prompt order: each free one is the lowest left of its KeyRun
            entry = free_keys.pop(key, None)
            if entry is None:
                refs[key] += 1
                continue
            entry.end -= 1
            if entry.keys[entry.end] != key:  # not its lowest (a held prefix makes it so; exact anyway)
                del entry.keys[entry.keys.index(key, entry.start)]
            if lru[entry] == 1:
                del lru[entry]
            else:
                lru[entry] -= 1
            self.lru_blocks -= 1
            refs[key] = 1

    def cache_keys(self, keys: Sequence, start: int, stop: int) -> int:
        """Give the caller's anonymous blocks start..stop-1 the keys keys[start:stop], up to the first
        key already cached by another block (that block and the ones after it stay anonymous).
        Returns the index reached."""
        refs, free_keys = self.refs, self.free_keys
        part = keys[start:stop]
        if refs.keys().isdisjoint(part) and free_keys.keys().isdisjoint(part):  # the usual case, in C
            refs.update(dict.fromkeys(part, 1))
            n = start + len(part)
        else:
            n = start
            for key in part:
                if key in refs or key in free_keys:
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
        if all(map((1).__eq__, map(refs.__getitem__, keys))):  # no one else holds them (in C)
            freed = keys[::-1]
            list(map(refs.pop, freed))
        else:  # some are held by others too (a shared prefix)
            freed = []
            for key in reversed(keys):
                left = refs[key] - 1
                if left:
                    refs[key] = left
                else:
                    del refs[key]
                    freed.append(key)
        if freed:
            entry = KeyRun(freed)
            lru[entry] = len(freed)
            self.free_keys.update(dict.fromkeys(freed, entry))
            self.lru_blocks += len(freed)
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
        runs = [e for e in self.lru if type(e) is KeyRun]
        if len(self.free_keys) != sum(e.end - e.start for e in runs) or any(
                self.lru[e] != e.end - e.start or any(self.free_keys.get(k) is not e for k in e.keys[e.start:e.end])
                for e in runs):
            raise AssertionError("free prompt keys and their free-queue entries disagree")
