"""The per-group managers of vLLM 0.33.0's hybrid KV cache (`SingleTypeKVCacheManager` and its
subclasses, vllm/v1/core/single_type_kv_cache_manager.py), over `block_pool.BlockPool`: one block
table per request, the blocks a step needs, what leaves the window, what gets a hash, and the
prefix hit each group can give. Line numbers are the released wheel's; `kv_cache_manager` holds
the managers together.

A port of that one vLLM file, class for class (the base manager and its sliding-window, chunked
and two Mamba subclasses, then the factory), so it stays whole above the usual module size: read
side by side with vLLM's file, a split would break the correspondence.
"""

from __future__ import annotations

from kvprobe.theory.model.sizes import cdiv
from kvprobe.theory.vllm.hybrid.block_pool import (
    NEVER,
    NULL,
    SPLIT,
    WINDOW_SPLIT,
    BlockPool,
    KVGroup,
    KVRequest,
    checkpoint_position,
    checkpoint_valid,
)

FULL, SLIDING, CHUNKED, MAMBA = "full", "sliding", "chunked", "mamba"


class Manager:
    """`SingleTypeKVCacheManager` for one group (full attention when no subclass changes it)."""

    kind = FULL

    def __init__(self, gid: int, group: KVGroup, pool: BlockPool, block_size: int, cap: int | None):
        self.gid, self.group, self.pool, self.B = gid, group, pool, block_size
        self.cap = cap  # max_admission_blocks_per_request (window and chunk groups)
        self.max_blocks = 0  # set by make_manager
        self.tables: dict[str, list[int]] = {}
        self.ncached: dict[str, int] = {}  # num_cached_block: running requests only

    def skipped_tokens(self, computed: int) -> int:
        return 0

    def split(self, skipped: bool) -> bool:
        """Whether this free sends blocks without a hash to the free queue's head (BlockPool.free_blocks):
        every free from 0.24.0; on 0.23.x a group's skipped blocks (remove_skipped_blocks) and a window
        group's freed request (SlidingWindowManager.free) only."""
        order = self.pool.free_order
        return order == SPLIT or (order == WINDOW_SPLIT and (skipped or self.kind == SLIDING))

    def hashable(self, req: KVRequest, start: int, end: int, align: int, retention, boundaries) -> list[bool] | None:
        return None  # reachable_block_mask: dense

    def blocks_to_allocate(self, req: KVRequest, num_tokens: int, hit: list[int], total_computed: int,
                           cap: bool = False, prefill_end: int = 0) -> int:
        required = cdiv(num_tokens, self.B)
        if cap and self.cap is not None:
            required = min(required, self.cap)
        table = self.tables.get(req.rid, ())
        if req.rid in self.ncached:
            return max(required - len(table), 0)
        skipped = self.skipped_tokens(total_computed) // self.B
        new = max(required - max(skipped, len(hit) + len(table)), 0)
        return new + self.pool.evictable(hit[max(0, skipped - len(table)):])

    def add_hit(self, req: KVRequest, hit: list[int], computed: int) -> None:
        table = self.tables.setdefault(req.rid, [])
        skipped = self.skipped_tokens(computed) // self.B
        rest = hit[skipped:] if skipped > 0 else hit
        if self.pool.caching:
            self.pool.touch(rest)
        table.extend([NULL] * skipped)
        table.extend(rest)
        self.ncached[req.rid] = len(table)

    def allocate(self, req: KVRequest, num_tokens: int) -> None:
        table = self.tables.setdefault(req.rid, [])
        new = cdiv(num_tokens, self.B) - len(table)
        if new > 0:
            table.extend(self.pool.get_new_blocks(new))

    def remove_skipped(self, req: KVRequest, processed: int) -> None:
        skipped = self.skipped_tokens(processed)
        if skipped <= 0:
            return
        table = self.tables.get(req.rid)
        if not table:
            return
        self._remove_range(req.rid, 0, min(skipped // self.B, len(table)))

    def _remove_range(self, rid: str, first: int, last: int) -> None:
        table = self.tables[rid]
        freed = []
        for i in range(min(last, len(table)) - 1, first - 1, -1):
            if table[i] == NULL:
                break
            freed.append(table[i])
            table[i] = NULL
        if freed:
            self.pool.free_blocks(freed, self.split(skipped=True))

    def cache_blocks(self, req: KVRequest, num_tokens: int, align: int, retention, boundaries) -> None:
        """cache_blocks up to `num_tokens` (already aligned by the coordinator)."""
        start = self.ncached.get(req.rid, 0)
        end = min(num_tokens, req.num_tokens // self.B * self.B) // self.B
        if start >= end:
            return
        table = self.tables[req.rid]
        mask = self.hashable(req, start, end, align, retention, boundaries)
        for i in range(start, end):
            if table[i] != NULL and (mask is None or mask[i - start]):
                self.pool.cache(table[i], (self.gid, req.key(i)))
        self.ncached[req.rid] = end

    def free(self, req: KVRequest) -> None:
        table = self.tables.pop(req.rid, [])
        self.ncached.pop(req.rid, None)
        start = 0
        while start < len(table) and table[start] == NULL:  # trim_null_head
            start += 1
        self.pool.free_blocks(reversed(table[start:]), self.split(skipped=False))

    def held(self, rid: str) -> int:
        return sum(1 for b in self.tables.get(rid, ()) if b != NULL)

    def quiet(self, rid: str) -> tuple[int, int, int]:
        """While a running request's slots stay <= the first value, min(slots, num_tokens) below
        the second and its processed tokens below the third, allocate_slots does nothing in this
        group (no block, no hash, no free): the scheduler may skip the call."""
        table = self.tables.get(rid, ())
        cache = (self.ncached.get(rid, 0) + 1) * self.B if self.pool.caching else NEVER
        return len(table) * self.B, cache, self.next_free(table, rid)

    def next_free(self, table: list[int], rid: str) -> int:
        """The least processed-token count at which remove_skipped frees a block: the one just past
        the leading nulls must leave (skipped_tokens >= (z + 1) x B)."""
        z = 0
        while z < len(table) and table[z] == NULL:
            z += 1
        return NEVER if z >= len(table) else self.first_skipping((z + 1) * self.B)

    def first_skipping(self, tokens: int) -> int:
        """The least computed count whose skipped_tokens reach `tokens`."""
        return NEVER

    # -- prefix hits (classmethods in vLLM; `gids` are the groups of one spec, looked up together)
    def cached_block(self, req: KVRequest, i: int, gids) -> list[int] | None:
        blocks = []
        for g in gids:
            b = self.pool.lookup((g, req.key(i)))
            if b == NULL:
                return None
            blocks.append(b)
        return blocks

    def find_hit(self, req: KVRequest, max_length: int, gids) -> tuple[list[list[int]], int]:
        out: list[list[int]] = [[] for _ in gids]
        for i in range(max_length // self.B):
            blocks = self.cached_block(req, i, gids)
            if blocks is None:
                break
            for lst, b in zip(out, blocks, strict=True):
                lst.append(b)
        return out, len(out[0]) * self.B


class SlidingManager(Manager):
    kind = SLIDING

    def skipped_tokens(self, computed: int) -> int:
        return max(0, computed - self.group.window + 1)  # L1148-1183 (no extra retained tokens)

    def first_skipping(self, tokens: int) -> int:
        return tokens + self.group.window - 1

    def need(self) -> int:
        return cdiv(self.group.window - 1, self.B)  # _contiguous_blocks_for_hit, no EAGLE

    def hashable(self, req, start, end, align, retention, boundaries):
        if align is None or align % self.B:
            return None
        need = self.need()
        mask = [False] * (end - start)
        segment = align if retention is None else (None if retention == 0 else retention)
        if segment is not None:
            per = segment // self.B
            if need >= per:
                return None
            for i in range(start, end):
                if i % per >= per - need:
                    mask[i - start] = True
        if retention is not None:
            for tokens in boundaries:
                e = tokens // align * align // self.B
                for j in range(max(start, e - need), min(end, e)):
                    mask[j - start] = True
        return mask

    def find_hit(self, req, max_length, gids):
        need, B = self.need(), self.B
        n = max_length // B
        out = [[NULL] * n for _ in gids]
        run = 0
        for i in range(n - 1, -1, -1):
            blocks = self.cached_block(req, i, gids)
            if blocks is None:
                run = 0
                continue
            for lst, b in zip(out, blocks, strict=True):
                lst[i] = b
            run += 1
            if run >= need:
                for lst in out:
                    del lst[i + run:]
                return out, len(out[0]) * B
        for lst in out:  # no full window: a run from block 0 still counts
            del lst[run:]
        return out, len(out[0]) * B


class ChunkedManager(Manager):
    kind = CHUNKED

    def skipped_tokens(self, computed: int) -> int:
        return computed // self.group.window * self.group.window  # L1381-1426

    def first_skipping(self, tokens: int) -> int:
        return cdiv(tokens, self.group.window) * self.group.window

    def find_hit(self, req, max_length, gids):
        C, B = self.group.window, self.B
        start = (max_length // C * C if max_length > 0 else 0) // B
        out = [[NULL] * start for _ in gids]
        for i in range(start, max_length // B):
            blocks = self.cached_block(req, i, gids)
            if blocks is None:
                break
            for lst, b in zip(out, blocks, strict=True):
                lst.append(b)
        return out, len(out[0]) * B


class MambaNoneManager(Manager):
    """A Mamba group without prefix caching: one block (of max_model_len tokens) per request."""

    kind = MAMBA

    def skipped_tokens(self, computed: int) -> int:
        return computed - 1

    def first_skipping(self, tokens: int) -> int:
        return tokens + 1


class MambaAlignManager(Manager):
    """A Mamba group in "align" mode (prefix caching on): the state after each block boundary
    lives in its own block; no speculative blocks. With prefill checkpoint blocks (group.checkpoint,
    FlashInfer's GDN prefill) the chunk that reaches the prefill's end and spans its last cacheable
    boundary gets one more block, at that boundary's index, into which the backend exports the
    boundary state (L1644-1797): the prompt is not split there, but it holds two new blocks."""

    kind = MAMBA

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.last_state: dict[str, int] = {}
        self.retired: dict[str, int] = {}
        self.allocated: set[str] = set()
        self.checkpoints: dict[str, tuple[int, int]] = {}  # _checkpoints: (position, block index)

    def skipped_tokens(self, computed: int) -> int:
        return computed - 1

    def next_free(self, table, rid):
        """_remove_range frees any live block from `retired` below (p - 1) // B, and the last state
        block goes once cdiv(p, B) - 1 passes it."""
        first = NEVER
        for j in range(self.retired.get(rid, 0), len(table)):
            if table[j] != NULL:
                first = (j + 1) * self.B + 1
                break
        last = self.last_state.get(rid)
        if last is not None and last < len(table) and table[last] != NULL:
            first = min(first, (last + 1) * self.B + 1)
        return first

    def hashable(self, req, start, end, align, retention, boundaries):
        if retention is None or align is None:
            return None
        per = (retention // self.B) if retention else 0
        if retention and per <= 1:
            return None
        mask = [False] * (end - start)
        if retention:
            first = (start + per) // per * per - 1
            for i in range(first - start, len(mask), per):
                mask[i] = True
        for tokens in boundaries:
            b = tokens // align * align // self.B - 1
            if start <= b < end:
                mask[b - start] = True
        return mask

    def find_hit(self, req, max_length, gids):
        out: list[list[int]] = [[] for _ in gids]
        for i in range(max_length // self.B - 1, -1, -1):
            blocks = self.cached_block(req, i, gids)
            if blocks is not None:
                for lst, b in zip(out, blocks, strict=True):
                    lst.extend([NULL] * i)
                    lst.append(b)
                return out, (i + 1) * self.B
        return out, 0

    def _remove_range(self, rid, first, last):
        table = self.tables.get(rid, [])
        first = max(first, self.retired.get(rid, 0))
        last = min(last, len(table))
        if first >= last:
            return
        freed = []
        for i in range(last - 1, first - 1, -1):
            if table[i] == NULL:
                continue
            freed.append(table[i])
            table[i] = NULL
        if freed:
            self.pool.free_blocks(freed, self.split(skipped=True))
        self.retired[rid] = last

    def remove_skipped(self, req, processed):
        super().remove_skipped(req, processed)
        last = self.last_state.get(req.rid)
        if last is not None and last < cdiv(processed, self.B) - 1:
            table = self.tables[req.rid]
            if table[last] != NULL:
                self.pool.free_blocks([table[last]], self.split(skipped=False))  # 0.23.0 L1045: to the tail
                table[last] = NULL

    def internal_checkpoint(self, req: KVRequest, start: int, end: int, prefill_end: int) -> int:
        """`_needs_internal_checkpoint` (L1644-1676) for the chunk [start, end): the checkpoint
        position, or 0. cache_hit_alignment_tokens is B here (one block size in align mode)."""
        if not self.group.checkpoint or end < prefill_end:
            return 0
        position = checkpoint_position(end, self.B)
        idx = cdiv(end, self.B) - 2
        table = self.tables.get(req.rid, ())
        if not checkpoint_valid(start, end, position, self.B, self.group.checkpoint) or idx < 0:
            return 0
        return position if idx >= len(table) or table[idx] == NULL else 0

    def blocks_to_allocate(self, req, num_tokens, hit, total_computed, cap=False, prefill_end=0):
        """get_num_blocks_to_allocate, align mode (L1678-1797); the per-step call (not the
        admission check) records the chunk's checkpoint for allocate and cache_blocks."""
        table = self.tables.get(req.rid, ())
        new = cdiv(num_tokens, self.B) - len(hit) - len(table)
        position = self.internal_checkpoint(req, total_computed, num_tokens, prefill_end)
        if not cap:
            if position:
                self.checkpoints[req.rid] = (position, cdiv(num_tokens, self.B) - 2)
            else:
                self.checkpoints.pop(req.rid, None)
        if new > 0:
            new = min(new, 1 + bool(position))  # physical_block_cap: one state block per step (+ checkpoint)
        return new + self.pool.evictable(hit)

    def allocate(self, req, num_tokens):
        """allocate_new_blocks, align mode (L1799-1903): nulls up to the new state block, but the
        checkpoint's index keeps a block of its own."""
        table = self.tables.setdefault(req.rid, [])
        required = cdiv(num_tokens, self.B)
        checkpoint = int(req.rid in self.checkpoints)
        if required <= len(table) and not checkpoint:
            self.allocated.add(req.rid)
            return
        prev = len(table)
        if req.rid in self.allocated or prev > 0:
            self.last_state[req.rid] = prev - 1
        if prev < required - 1:
            table.extend([NULL] * (required - 1 - checkpoint - prev))
        table.extend(self.pool.get_new_blocks(max(required - len(table), 0)))
        self.allocated.add(req.rid)

    def cache_blocks(self, req, num_tokens, align, retention, boundaries):
        """cache_blocks then `_cache_partial_tail_block` (L2029-2085) for a recorded checkpoint:
        the prompt's checkpoint block keeps the hash of the blocks up to its position (the dense
        pass gave it that hash already: position = (index + 1) x B); any other checkpoint's state
        is transient, and its block loses a hash unless retained or the shared-prefix junction."""
        super().cache_blocks(req, num_tokens, align, retention, boundaries)
        if req.rid not in self.checkpoints:
            return
        position, idx = self.checkpoints[req.rid]
        block = self.tables[req.rid][idx]
        retained = self.hashable(req, idx, idx + 1, align, retention, ())
        if (position != checkpoint_position(req.num_prompt_tokens, align) and not (retained is None or retained[0])
                and position != req.shared_prefix_boundary):
            self.pool.uncache(block)
        elif self.pool.hash[block] != (key := (self.gid, req.key(idx))):  # replace_existing_hashes
            self.pool.uncache(block)
            self.pool.cache(block, key)

    def free(self, req):
        self.allocated.discard(req.rid)
        self.last_state.pop(req.rid, None)
        self.retired.pop(req.rid, None)
        self.checkpoints.pop(req.rid, None)
        super().free(req)


def make_manager(gid: int, group: KVGroup, pool: BlockPool, *, block_size: int, caching: bool,
                 max_model_len: int, in_flight: int, admission_cap: bool = True) -> Manager:
    """`get_manager_for_kv_cache_spec` (single_type_kv_cache_manager.py L2608-2653). Each manager
    also knows `max_blocks`, what one request can hold in the group at most (the spec's
    max_memory_usage_bytes / page, as kv_cache_spec.VllmLayerSpec.blocks_per_request computes it);
    without `admission_cap` (before 0.20.0: releases.WINDOW_CAP_FROM) a window group's admission is uncapped."""
    B = group.block_size or block_size
    if group.kind == FULL:
        m = Manager(gid, group, pool, B, None)
        m.max_blocks = cdiv(max_model_len, B)
    elif group.kind == SLIDING:  # SlidingWindowSpec.max_admission_blocks_per_request (kv_cache_interface.py L917-944)
        most = cdiv(min(group.window - 1 + in_flight, max_model_len), B) + 1
        m = SlidingManager(gid, group, pool, B, most if admission_cap else None)  # no cap: the whole prompt
        m.max_blocks = most
    elif group.kind == CHUNKED:  # ChunkedLocalAttentionSpec (L864-881)
        most = cdiv(min(group.window + in_flight, max_model_len), B)
        m = ChunkedManager(gid, group, pool, B, most if admission_cap else None)
        m.max_blocks = most
    elif group.kind == MAMBA:  # MambaSpec.max_memory_usage_bytes (L1135-1141)
        m = (MambaAlignManager if caching else MambaNoneManager)(gid, group, pool, B, None)
        m.max_blocks = 2 + bool(group.checkpoint) if caching else 1
    else:
        raise ValueError(f"unknown KV group kind {group.kind!r}")
    return m
