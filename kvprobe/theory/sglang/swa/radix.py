"""SGLang 0.5.23's hybrid sliding-window scheduler with the radix cache ON (its default).

With the radix cache on, a hybrid SWA model's tree is the UnifiedRadixCache with a FULL and an
SWA component (mem_cache/registry.py L150-191). For kvprobe's closed loop (every prompt unique from
its first token: nothing is ever matched) its effect on the window pool reduces to who owns which
window slots, and what the engine counts as used (capacity - available - evictable, the driver's
`used_tokens`, pool_stats_observer.py L312-330):

* A request's computed prefix enters the tree when its prefill's (or chunk's) result is processed
  (`checkpoint_into_tree`, mem_cache/unified_radix_cache.py L1164-1317: `cache_protected_len` is the
  page-floored length inserted) and the request locks it. The lock holds the FULL slots of the whole
  path but only the trailing window of SWA slots: ceil_align(max(window, page), page) tokens (the
  SWA component's retain window, unified_cache/components/swa.py L93-97; the Rust tree core gets
  it as `swa_sliding_window_size`, rust_tree_core/adapter.py L483). The rest of the prefix's window
  slots are evictable at once: a prompt of 300 on a window of 127 counts 128 window slots used
  after its prefill (127 locked + the first decode slot), not 301.
* Decode frees the request's own out-of-window slots (`maybe_evict_swa`, managers/schedule_batch.py
  L4068-4123; `free_swa_out_of_window_slots`, mem_cache/common.py L75-138) when
  seqlen - 1 - window >= evicted + SGLANG_SWA_EVICTION_INTERVAL, from evicted =
  max(evicted, cache_protected_len) (`swa_dead_lo`, schedule_batch.py L994-1000: the tree's slots are
  the tree's) up to page_floor(seqlen - 1 - ceil_align(max(window, page), page)) (prefix sharing:
  a key ending at the page floor keeps a full window). `evicted` starts at 0, so the first firing
  comes after 128 tokens past the window counted from 0, then 128 past the last.
  No window is freed on extend (the extend branch runs only without prefix sharing, L4105).
* A finished request's sequence enters the tree unlocked and a retracted request's lock is released:
  every window slot it held becomes free or evictable. Evicting a tree node moves slots from
  evictable to available, so neither the engine's used count nor admission (`remaining_swa` =
  swa available + swa evictable - offset, mem_cache/prefill_budget.py L219-222) nor the decode check
  (`check_decode_capacity` evicts, then compares, allocator/base.py L171-185) depends on which node
  the LRU picks: the window pool is tracked here as used slots, its `available` being SGLang's
  available + evictable.

The full pool is the base scheduler's radix tree (sglang/scheduler.py). Checked step by step against
SGLang's own Scheduler (tests/theory/test_real_sglang.py, the "swa radix on" shapes).
"""

from __future__ import annotations

import numpy as np

from kvprobe.theory.sglang.pools import SWA_EVICTION_INTERVAL
from kvprobe.theory.sglang.swa.scheduler import SglangSwaScheduler
from kvprobe.theory.sim.core import SglangConfig, SimRequest


class SglangSwaRadixScheduler(SglangSwaScheduler):
    """SglangSwaScheduler with the radix cache on (see the module docstring)."""

    _radix_modelled = True

    def __init__(self, config: SglangConfig):
        super().__init__(config)
        # window slots the tree's lock keeps of a request's cached prefix (the retain window in pages)
        self.R = self.ceil_page(max(self.W, self.ps))
        self._releasing = False

    def _match(self, req: SimRequest, limit: int):
        """A unique prompt matches nothing, except a retracted request's own prompt still in the
        tree. SGLang then matches nothing either when that path has lost its window slots (the
        SWA match validator wants a live window, components/swa.py L357-377), but on insert it
        re-adopts the full-only nodes it overlaps and locks their window slots
        (`update_component_on_insert_overlap`, L471-513), which depends on which slots the two
        LRUs evicted meanwhile: not modelled. Its admission is counted in stats.swa_radix_readopted, so a caller
        knows the trace from there on is not SGLang's; the request matches nothing here."""
        node, prefix = super()._match(req, limit)
        req._readopt = bool(prefix and req.num_preemptions)
        return (self.pool.root, 0) if req._readopt else (node, prefix)

    # -- what a request holds in the window pool
    def _window_used(self, req: SimRequest, held: int, ev: int) -> int:
        """Slots counted used: its own slots above the tree's prefix and above what it freed, plus
        the window slots its lock holds in the tree (from its lowest locked node up)."""
        cached = req._cached
        return self.ceil_page(held) - max(ev, cached) + cached - getattr(req, "_swa_lock_lo", 0)

    def _window_held(self, row: dict[str, int], req: SimRequest) -> int:
        return self._window_used(req, row["held"], row.get("ev", getattr(req, "_swa_ev", 0)))

    def _held_and_ev(self, req: SimRequest) -> tuple[int, int]:
        if req is self.chunked or req.status != "running":
            return req.num_computed_tokens, getattr(req, "_swa_ev", 0)
        row = self.run.row(self.run.index(req))
        return row["held"], row["ev"]

    def _lock_from(self, req: SimRequest, c0: int, c: int) -> int:
        """The request's tree path ends in nodes cut at each checkpoint, a fresh leaf longer than
        the retain window cut one page-aligned window from its end (`_maybe_split_leaf_for_swa_lock`,
        components/swa.py L593-618); the lock holds the window slots of its last nodes until they
        cover the window (a node at a time: a last chunk of 40 locks it and the 127 above it)."""
        bounds = req.__dict__.setdefault("_swa_bounds", [0])
        if c > c0:
            if c - c0 > self.R:
                bounds.append(c - self.R)
            bounds.append(c)
        i = len(bounds) - 1
        while i > 0 and c - bounds[i] < self.W:
            i -= 1
        return bounds[i]

    def _checkpoint(self, req: SimRequest, upto: int) -> None:
        """The prefix enters the tree: its window slots below the locked nodes turn evictable (the
        lock moves from the earlier chunk's node to this one)."""
        if self._releasing:  # _release accounts for the whole request itself
            return super()._checkpoint(req, upto)
        held, ev = self._held_and_ev(req)
        before, c0 = self._window_used(req, held, ev), req._cached
        super()._checkpoint(req, upto)
        req._swa_lock_lo = self._lock_from(req, c0, req._cached)
        self.swa.free(before - self._window_used(req, held, ev))
        self._set_ev(req, self._checkpoint_ev(ev, c0, upto - 1))

    def _checkpoint_ev(self, ev: int, c0: int, pre: int) -> int:
        """checkpoint_into_tree frees the request's out-of-window slots before it inserts
        (unified_radix_cache.py L1211-1221, SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS on):
        free_swa_out_of_window_slots at pre_len = the inserted length - 1, interval 1, from
        max(evicted, the earlier cache_protected_len). The slots it frees lie below the locked
        nodes, already not counted used here; what it moves is `evicted`, the decode trigger's
        base (a request of 1100 in chunks of 512 first evicts at seqlen 1280, not 1355)."""
        if pre - self.W < ev + 1:
            return ev
        ev = max(ev, c0)
        return max(ev, max(ev, pre - self.R) // self.ps * self.ps)

    def _set_ev(self, req: SimRequest, ev: int) -> None:
        if req is self.chunked or req.status != "running":
            req._swa_ev = ev
        else:
            self.run("ev")[0][self.run.index(req)] = ev

    def _alloc_extend(self, n: int, req: SimRequest) -> None:
        """No window is freed on extend with prefix sharing (schedule_batch.py L4105-4107)."""
        self.pool.alloc(n)
        self.swa.alloc(n)
        req._ebi = getattr(req, "_ebi", 0) + 1
        if getattr(req, "_readopt", False):  # admitted onto its old path (see _match)
            self.stats.swa_radix_readopted += 1
            req._readopt = False

    def _evict_windows(self, active: np.ndarray) -> None:
        """maybe_evict_swa with the tree: the trigger from `evicted` (0 at first), the slots freed
        from max(evicted, cache_protected_len) to page_floor(seqlen - 1 - R)."""
        plen, out, ev, dbi = self.run("plen", "out", "ev", "dbi")
        seq1 = plen + out - 1
        due = active & (dbi >= 1) & (seq1 - self.W >= ev + SWA_EVICTION_INTERVAL)
        if not due.any():
            return
        cached = np.fromiter((r._cached for r in self.run.reqs), np.int64, self.run.n)
        lo = np.maximum(ev, cached)
        new = np.maximum(lo, seq1 - self.R) // self.ps * self.ps
        freed = np.where(due & (new > lo), new - lo, 0)
        self.swa.free(int(freed.sum()))
        ev[:] = np.where(due, np.maximum(lo, new), ev)

    def _release(self, req, row, *, finished, result) -> None:
        """Finished (its sequence enters the tree unlocked) or retracted (its lock released): every
        window slot it held is free or evictable."""
        self.swa.free(self._window_held(row, req))
        req._swa_ev = req._ebi = req._swa_lock_lo = 0
        req._swa_bounds = [0]
        self._releasing = True
        try:
            super(SglangSwaScheduler, self)._release(req, row, finished=finished, result=result)  # the full pool's
        finally:
            self._releasing = False

