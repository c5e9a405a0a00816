"""The block pool of vLLM 0.33.0's hybrid KV cache with explicit block ids (`BlockPool`,
v1/core/block_pool.py), the groups and the request as its managers read them. See kv_cache_manager.py.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvprobe.theory.model.sizes import cdiv

NEVER = 1 << 60
NULL = 0  # block 0 is the null block: a table entry that holds nothing (block_pool.py L180-186)
# Where a freed block goes in the free queue, by release (theory/vllm/releases.py UNHASHED_FIRST_FROM):
# SPLIT, every free sends the blocks without a hash to the head, reused first, and the hashed ones to the tail
# (0.24.0 on: block_pool.py free_blocks); WINDOW_SPLIT, only a group's skipped blocks and a window group's
# freed request do (0.23.x: single_type_kv_cache_manager.py L470-501, L752-764), the rest go to the tail;
# TAIL, every freed block to the tail in the order given (through 0.22.1: `append_n` alone).
SPLIT, WINDOW_SPLIT, TAIL = "split", "window split", "tail"


def checkpoint_position(num_tokens: int, block: int) -> int:
    """`get_mamba_prefill_checkpoint_position` (v1/kv_cache_interface.py L1169-1186) without EAGLE
    or lookahead hashes: the last block boundary that leaves at least one token to recompute."""
    return max((num_tokens - 1) // block * block, 0)


def checkpoint_valid(start: int, end: int, position: int, block: int, alignment: int) -> bool:
    """`is_mamba_prefill_checkpoint_valid` (kv_cache_interface.py L1189-1212), hash block = Mamba
    block: the backend can export the state at `position` from inside the chunk [start, end)."""
    if not alignment:
        return False
    return (start % block == 0 and cdiv(end, block) - 2 > (start - 1) // block and start + block <= position
            and start < position < end and (position - start) % alignment == 0)


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group as the scheduler's KV cache manager sees it (`KVCacheGroupSpec`).

    `copies` identical groups (same spec: Gemma 3's window layers in six groups) are one entry;
    each copy keeps its own block table, frees and is looked up with the others. `window` is the
    sliding window or the attention chunk size; `block_size` 0 means the scheduler's block size
    (a Mamba group without prefix caching has one block of max_model_len tokens). `checkpoint` is
    a Mamba group's `prefill_checkpoint_alignment` in tokens when its spec has
    `num_prefill_checkpoint_blocks` = 1 (FlashInfer's GDN prefill exports the prompt's boundary
    state from inside the final chunk into one more block), 0 when it has none."""

    kind: str
    copies: int = 1
    window: int = 0
    block_size: int = 0
    checkpoint: int = 0


@dataclass
class KVRequest:
    """What the KV cache manager reads of a request (`vllm.v1.request.Request`)."""

    rid: str
    num_prompt_tokens: int
    pkeys: list  # chained hashes of the prompt's full blocks (pools.prompt_keys)
    num_tokens: int = 0  # prompt + outputs known (placeholders excluded)
    num_computed_tokens: int = 0
    num_in_flight_tokens: int = 0
    shared_prefix_boundary: int = 0
    waiting: bool = True  # WAITING / PREEMPTED: the watermark applies

    def key(self, i: int):
        return self.pkeys[i] if i < len(self.pkeys) else (self.rid, i)


class BlockPool:
    """`BlockPool` with explicit block ids; see the module doc."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, free_order: str = SPLIT):
        self.num_gpu_blocks = num_gpu_blocks
        self.caching = enable_caching
        self.free_order = free_order  # SPLIT, WINDOW_SPLIT or TAIL: the managers' free calls read it
        self.ref = [0] * num_gpu_blocks
        self.hash: list = [None] * num_gpu_blocks
        self.queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_gpu_blocks))
        self.cached: dict = {}  # (group, key) -> {block: None}, oldest first

    @property
    def num_free(self) -> int:
        return len(self.queue)

    @property
    def usage(self) -> float:
        total = self.num_gpu_blocks - 1
        return 1.0 - len(self.queue) / total if total else 0.0

    def get_new_blocks(self, n: int) -> list[int]:
        if n > len(self.queue):
            raise RuntimeError(f"block pool over-allocated: need {n}, free {len(self.queue)}")
        out = []
        for _ in range(n):
            block, _ = self.queue.popitem(last=False)
            self.uncache(block)  # evicted from the prefix cache
            self.ref[block] = 1
            out.append(block)
        return out

    def touch(self, blocks) -> None:
        for block in blocks:
            if block == NULL:
                continue
            if self.ref[block] == 0:
                del self.queue[block]
            self.ref[block] += 1

    def free_blocks(self, ordered, split: bool = True) -> None:
        """Blocks in eviction order (the first is evicted first): with `split`, those without a hash to
        the head of the free queue, reused first, the hashed ones to the tail (0.33.0 L816-849); without,
        every freed block to the tail in the order given, hashed or not (0.18.1 block_pool.py L409-423,
        `append_n` alone). Which free splits is the release's `free_order`."""
        first, last = [], []
        for block in ordered:
            if block == NULL:
                continue
            self.ref[block] -= 1
            if self.ref[block] == 0:
                head = split and (self.hash[block] is None or not self.caching)
                (first if head else last).append(block)
        queue = self.queue
        for block in reversed(first):  # prepend_n keeps their order at the head
            queue[block] = None
            queue.move_to_end(block, last=False)
        for block in last:
            queue[block] = None

    def cache(self, block: int, h) -> None:
        if block == NULL or self.hash[block] == h:
            return
        self.hash[block] = h
        self.cached.setdefault(h, {})[block] = None

    def uncache(self, block: int) -> None:
        """`_maybe_evict_cached_block`: the block keeps its place but loses its hash."""
        h = self.hash[block]
        if block == NULL or h is None:
            return
        entry = self.cached[h]
        del entry[block]
        if not entry:
            del self.cached[h]
        self.hash[block] = None

    def lookup(self, h) -> int:
        entry = self.cached.get(h)
        return next(iter(entry)) if entry else NULL

    def evictable(self, blocks) -> int:
        return sum(1 for b in blocks if b != NULL and self.ref[b] == 0)
