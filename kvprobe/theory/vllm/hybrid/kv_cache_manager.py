"""vLLM 0.33.0's KV cache manager for hybrid models (several KV cache groups in one block pool),
as the simulated scheduler `scheduler.py` (here) drives it.

A full-attention model has one group, and `vllm/block_pool.py` reduces it to counts and runs. A hybrid
model's groups free blocks while a request runs (the window slides past them), cache only some of
them (sparse retention) and agree on a prefix hit through a fixed point, so this module keeps
what vLLM keeps: block ids, reference counts, the free queue in order, the hash map, and one block
table per request and group. Every rule is a port of the engine's own code (0.33.0, released
wheel):

* `BlockPool` (v1/core/block_pool.py): the free queue pops from its head; `free_blocks` prepends
  unhashed blocks (reused first) and appends hashed ones (evicted last, LRU) L816-849; a reused
  hashed block loses its hash (`_maybe_evict_cached_block`); no de-duplication of equal hashes
  (`BlockHashToBlockMap` L36-96); usage = 1 - free / (num_gpu_blocks - 1) (L921-932).
* The managers (v1/core/single_type_kv_cache_manager.py): `get_num_blocks_to_allocate` L176-266
  (the recycling-aware admission cap of window and chunk groups L215-227), `add_local_computed_blocks`
  L268-325, `allocate_new_blocks` L370-410, `remove_skipped_blocks` L655-720 (what leaves the window
  is freed, last block first), `cache_blocks` L477-543 with the sparse-retention masks of window
  (L1067-1146) and Mamba groups (L1549-1606), and the hit finders (full L743-838, window L969-1065,
  chunked-local L1282-1379, Mamba L1470-1547). Mamba's "align" mode: L1608-1797 (one state block
  per step, the previous one freed when the next is processed; no speculative blocks).
* The coordinator (v1/core/kv_cache_coordinator.py): the hybrid hit is a fixed point over the spec
  groups, full attention first (L806-941), and a shorter reconciled hit than some group's own is
  remembered as the request's `shared_prefix_boundary` (kv_cache_manager.py L323-328); prefixes
  are cached at scheduler-block granularity (L777-804); replay boundary num_prompt_tokens - 1
  (L65-87).
* `allocate_slots` (v1/core/kv_cache_manager.py L380-627): the full-sequence admission check with
  the cap, then skipped blocks freed on the processed-token basis (num_computed - num_in_flight),
  then the step's blocks.

Block hashes: a request's block i is keyed by its chained prompt hash while it lies in the prompt
(`pools.prompt_keys`: identical prompts share blocks) and by (request, i) beyond (its outputs are
its own). Mamba prefill checkpoint blocks (FlashInfer's GDN prefill): `MambaAlignManager`. Not
modelled (refused by the scheduler): speculative decoding, KV connectors, several full-attention
groups.
"""

from __future__ import annotations

import math

from kvprobe.theory.model.sizes import cdiv
from kvprobe.theory.vllm.hybrid.block_pool import NEVER, NULL, SPLIT, BlockPool, KVGroup, KVRequest  # noqa: F401

# the public API is imported from here
from kvprobe.theory.vllm.hybrid.single_type_managers import (  # noqa: F401
    CHUNKED,
    FULL,
    MAMBA,
    SLIDING,
    Manager,
    make_manager,
)


class HybridKVManager:
    """`KVCacheManager` + its coordinator for these groups: one pool, a manager per group copy."""

    def __init__(self, groups: tuple[KVGroup, ...], num_gpu_blocks: int, *, block_size: int, caching: bool,
                 max_model_len: int, in_flight: int, watermark_blocks: int = 0, retention: int | None = 0,
                 admission_cap: bool = True, free_processed: bool = True, free_order: str = SPLIT):
        # retention None: dense (every full block cached); free_order: block_pool.SPLIT, WINDOW_SPLIT, TAIL
        self.pool = BlockPool(num_gpu_blocks, caching, free_order)
        # older releases (theory/vllm/releases.py WindowRules): no cap in the full-sequence check before
        # 0.20.0; skipped blocks freed on num_computed, not num_computed - num_in_flight, before 0.26.0
        self.free_processed = free_processed
        self.caching, self.mml, self.watermark = caching, max_model_len, watermark_blocks
        self.managers: list[Manager] = []
        self.spec_groups: list[tuple[Manager, list[int]]] = []  # (first manager, group ids), full first
        for group in groups:
            gids = []
            for _ in range(group.copies):
                gid = len(self.managers)
                self.managers.append(make_manager(gid, group, self.pool, block_size=block_size, caching=caching,
                                                  max_model_len=max_model_len, in_flight=in_flight,
                                                  admission_cap=admission_cap))
                gids.append(gid)
            self.spec_groups.append((self.managers[gids[0]], gids))
        self.spec_groups.sort(key=lambda sg: sg[0].kind != FULL)  # verify_and_split_kv_cache_groups L718-775
        self.hybrid = len(self.managers) > 1
        sizes = [m.B for m in self.managers]
        self.sched_block = math.lcm(*sizes)  # resolve_kv_cache_block_sizes (kv_cache_utils.py L816-866)
        self.align = self.sched_block  # cache_hit_alignment_tokens: no partial hash hits (equal block sizes)
        self.retention = retention
        self.simple = len(self.spec_groups) == 2 and self.spec_groups[0][0].kind == FULL

    @property
    def request_blocks(self) -> int:
        """Blocks one request of max_model_len holds at most over all groups: the divisor of
        vLLM's "maximum concurrency" and its startup check (kv_cache_utils.py L1061-1128, L50-87)."""
        return sum(m.max_blocks for m in self.managers)

    # -- prefix hits
    def find_hit(self, req: KVRequest) -> tuple[list[list[int]], int, int]:
        """get_computed_blocks: (hit blocks per group, hit tokens, shared_prefix_boundary)."""
        empty = [[] for _ in self.managers]
        if not self.caching:
            return empty, 0, 0
        max_length = req.num_tokens - 1
        if not self.hybrid:
            m = self.managers[0]
            blocks, n = m.find_hit(req, max_length, [0])
            return blocks, n, 0
        hit_length, longest = max_length, 0
        found: dict[int, tuple[list[list[int]], int]] = {}
        while True:
            curr = hit_length
            for i, (m, gids) in enumerate(self.spec_groups):
                if m.kind == FULL and i in found:
                    curr = min(curr, found[i][1])
                    continue
                blocks, curr = m.find_hit(req, curr, gids)
                found[i] = (blocks, curr)
                longest = max(longest, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if self.simple:
                break
        out = [[] for _ in self.managers]
        for i, (m, gids) in enumerate(self.spec_groups):
            blocks = found.get(i, ([[] for _ in gids], 0))[0]
            for gid, lst in zip(gids, blocks, strict=True):
                out[gid] = lst[:cdiv(hit_length, m.B)] if m.kind == FULL else lst
        uncached = longest - hit_length
        return out, hit_length, (hit_length + uncached if uncached else 0)

    # -- allocation
    def allocate_slots(self, req: KVRequest, num_new_tokens: int, hits: list[list[int]] | None = None,
                       num_new_computed: int = 0, *, full_must_fit: bool = False, has_scheduled: bool = True) -> bool:
        """allocate_slots (kv_cache_manager.py L380-627); False when the blocks do not fit."""
        managers, pool = self.managers, self.pool
        hits = hits or [[] for _ in managers]
        local = req.num_computed_tokens + num_new_computed
        total = min(local, self.mml)
        wm = self.watermark if has_scheduled and req.waiting else 0
        end = self.prefill_end(req)
        if full_must_fit:
            full = min(req.num_tokens, self.mml)
            need = sum(m.blocks_to_allocate(req, full, h, total, cap=True, prefill_end=end)
                       for m, h in zip(managers, hits, strict=True))
            if need + wm > pool.num_free:
                return False
        slots = min(total + num_new_tokens, self.mml)
        processed = max(0, total - req.num_in_flight_tokens) if self.free_processed else total
        for m in managers:
            m.remove_skipped(req, processed)
        need = sum(m.blocks_to_allocate(req, slots, h, local, prefill_end=end)
                   for m, h in zip(managers, hits, strict=True))
        if need + wm > pool.num_free:
            return False
        if any(hits):
            for m, h in zip(managers, hits, strict=True):
                m.add_hit(req, h, local)
        for m in managers:
            m.allocate(req, slots)
        if self.caching:
            self.cache_blocks(req, min(total + num_new_tokens, req.num_tokens))
        return True

    def prefill_end(self, req: KVRequest) -> int:
        """Where the request's prefill ends (kv_cache_manager.py L527-529); the coordinator passes
        0 under dense or interval retention, where every chunk may check-point (coordinator L237-238)."""
        return max(req.num_prompt_tokens, req.num_tokens - 1) if self.retention == 0 else 0

    def cache_blocks(self, req: KVRequest, num_tokens: int) -> None:
        n = num_tokens // self.sched_block * self.sched_block if self.hybrid else num_tokens
        bounds = [req.num_prompt_tokens - 1]  # replay_boundaries, no EAGLE
        if req.shared_prefix_boundary:
            bounds.append(req.shared_prefix_boundary)
        for m in self.managers:
            m.cache_blocks(req, n, self.align, self.retention, bounds)

    def free(self, req: KVRequest) -> None:
        for m in self.managers:
            m.free(req)

    def held(self, rid: str) -> int:
        return sum(m.held(rid) for m in self.managers)

    def quiet(self, rid: str) -> tuple[int, int, int]:
        """Manager.quiet over all groups."""
        out = [NEVER, NEVER, NEVER]
        for m in self.managers:
            out = [min(a, b) for a, b in zip(out, m.quiet(rid), strict=True)]
        return out[0], out[1], out[2]

    def check(self, rids) -> None:
        """Leak check: every block out of the free queue is held by a running request."""
        held = {}
        for m in self.managers:
            for rid in rids:
                for b in m.tables.get(rid, ()):
                    if b != NULL:
                        held[b] = held.get(b, 0) + 1
        in_use = self.pool.num_gpu_blocks - 1 - self.pool.num_free
        if len(held) != in_use or any(self.pool.ref[b] != n for b, n in held.items()):
            raise AssertionError(f"hybrid block pool leak: {in_use} blocks in use, running requests hold "
                                 f"{len(held)}")
