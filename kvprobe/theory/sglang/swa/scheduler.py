"""SGLang 0.5.23's scheduler on a hybrid sliding-window model (gpt-oss, Llama 4): two token pools.

SGLang keeps the full-attention layers' KV in one pool (`max_total_num_tokens`) and the window
layers' KV in a second (`max_total_num_tokens_swa`, sizes: sglang/pools.py); every token a request
computes takes a slot in both (`SWATokenToKVPoolAllocator`, mem_cache/allocator/swa.py L40-242:
alloc_extend / alloc_decode take both, `available_size` is the smaller). What differs from one
pool (files and lines of the released wheel, `sglang/srt/...`):

* Out-of-window slots are freed as a request grows (`ScheduleBatch.maybe_evict_swa`,
  managers/schedule_batch.py L4047-4123, called by alloc_for_decode, mem_cache/allocation.py
  L633): when a decode batch is prepared, a request in its second decode batch or later whose
  `seqlen - 1 - window >= evicted + SGLANG_SWA_EVICTION_INTERVAL` (128, environ.py L730) frees
  its window slots below `seqlen - 1 - window`, page-floored (`free_swa_out_of_window_slots`,
  mem_cache/common.py L75-138; seqlen = prompt + output ids processed so far, L1490-1492). So a
  request holds at most window + 128 + a page of window slots between evictions.
* Admission (`SWAPrefillBudget`, mem_cache/prefill_budget.py L202-360) checks the full pool as for
  one pool and the window pool with `estimate_swa_kv_tokens` (L25-56): a new request's window
  charge is max(min(extend, chunk) - window, 0) + min(extend + max_new, window) + page. Running
  requests are charged nothing in the window pool (its offset starts at 0 each pass), only what
  this pass admits. `check_prefill` asks `needed < remaining_swa` (L254-290);
  `add_one_req_ignore_eos` asks `<=` (L329-347) and skips its walk over the running requests'
  futures on a hybrid SWA pool (schedule_policy.py L1292-1304); a pass stops (NO_TOKEN) once the
  window room is spent (`has_capacity`, L319-320); a chunked request is parked when the window
  has no room beyond a page (`available_chunk_tokens`, L322-327).
* Decode (`check_decode_mem`, schedule_batch.py L3432-3449, allocator/swa.py L160-166): the
  step's pages must fit in both pools, before this step's out-of-window slots are freed (they
  are freed when the batch allocates, after the check); retraction (L3451-3580) frees both.
* The usage the engine exports per pool (`_get_swa_token_info`, managers/scheduler_components/
  pool_stats_observer.py L304-345): capacity - available - evictable of each pool.

Modelled here: the radix cache off (`--disable-radix-cache`: nothing is cached). The radix cache on
(SGLang's default) is the subclass in sglang/swa/radix.py. Checked step by step against SGLang's own Scheduler
(tests/theory/test_real_sglang.py, the hybrid shapes).
"""

from __future__ import annotations

import numpy as np

from kvprobe.errors import ConfigError
from kvprobe.theory.sglang.pools import SWA_EVICTION_INTERVAL  # SGLANG_SWA_EVICTION_INTERVAL, 128
from kvprobe.theory.sglang.scheduler import SglangScheduler
from kvprobe.theory.sim.core import Lanes, SglangConfig, SimRequest


def is_hybrid_swa(config: SglangConfig) -> bool:
    return config.sliding_window_size is not None


class WindowPool:
    """The sliding-window layers' token slots (no tree: the radix cache is off)."""

    def __init__(self, size: int):
        self.size = size
        self.available = size

    @property
    def used(self) -> int:
        return self.size - self.available

    def alloc(self, n: int) -> None:
        if n > self.available:
            raise RuntimeError(f"window pool over-allocated: need {n}, available {self.available}")
        self.available -= n

    def free(self, n: int) -> None:
        self.available += n


class SglangSwaScheduler(SglangScheduler):
    """SglangScheduler with a window pool beside the full one (see the module docstring)."""

    _simulates_future = False  # schedule_policy.py L1292-1304
    _radix_modelled = False  # the radix cache on: SglangSwaRadixScheduler

    def __init__(self, config: SglangConfig):
        if not config.disable_radix_cache and not self._radix_modelled:
            raise ConfigError("SglangSwaScheduler models the radix cache off; with it on, use "
                              "SglangSwaRadixScheduler (theory/sglang/swa/radix.py)", key="disable_radix_cache")
        if not config.swa_pool_tokens or config.sliding_window_size <= 0:
            raise ConfigError("a hybrid sliding-window SGLang config needs the window pool's size and the "
                              "window", key="swa_pool_tokens")
        self.W = config.sliding_window_size
        self.swa = WindowPool(config.swa_pool_tokens)
        super().__init__(config)
        # ev: window slots below it are freed (evicted_seqlen); dbi: decode batches it was in
        self.run = Lanes((*self.run.cols, "ev", "dbi"))
        self._swa_free = self._swa_offset = 0

    def step(self):
        """Every prefill attempt on a hybrid SWA pool clears the batch_full latch first
        (`_get_new_batch_prefill_raw`, managers/scheduler.py L4090-4092): window slots come back
        as requests grow, not only when one leaves."""
        self.batch_full = False
        return super().step()

    # -- admission (SWAPrefillBudget)
    def _swa_tokens(self, ext: int, max_new: int, chunk_limit: int | None) -> int:
        """estimate_swa_kv_tokens (prefill_budget.py L25-56), no host hit."""
        allocated = ext if chunk_limit is None else min(ext, chunk_limit)
        return max(allocated - self.W, 0) + min(ext + max_new, self.W) + self.ps

    def _swa_pass_start(self) -> None:
        self._swa_free, self._swa_offset = self.swa.available, 0

    def _swa_left(self) -> float:
        """remaining_swa (L219-222): available (this model allocates at admission, SGLang after
        the pass, so the pass start's) minus what this pass reserved."""
        return self._swa_free - self._swa_offset

    def _swa_check_prefill(self, ext, max_new, chunk_limit):
        """SWAPrefillBudget.check_prefill's window part (L254-290): strict; a request that could
        never fit the window pool is cut to a chunk the window room holds."""
        ext = self.ceil_page(ext)
        needed = self._swa_tokens(ext, max_new, chunk_limit)
        if needed < self._swa_left():
            return True, chunk_limit
        cap = 0
        if needed >= self.swa.size:  # swa_never_fits (L234-240) -> _chunk_cap (L242-248)
            cap = max(0, int(self._swa_left() - self._swa_tokens(0, max_new, None)) // self.ps * self.ps)
        if chunk_limit is None or cap <= 0:
            self.stats.window_no_token_total += 1
            return False, None
        return True, min(chunk_limit, cap)

    def _swa_fits_ignore_eos(self, ext, max_new, chunk_limit) -> bool:
        fits = self._swa_tokens(ext, max_new, chunk_limit) <= self._swa_left()  # can_allocate_prefill
        self.stats.window_no_token_total += not fits
        return fits

    def _swa_reserve(self, paged, max_new, chunk_limit) -> None:
        self._swa_offset += self._swa_tokens(paged, max_new, chunk_limit)  # reserve (L349-365)

    def _alloc_extend(self, n: int, req: SimRequest) -> None:
        """alloc_for_extend: maybe_evict_swa first (a chunked request's window below its earlier
        chunks, schedule_batch.py L4105-4123), then slots in both pools; the request's
        extend_batch_idx counts this batch after the allocation (L2932)."""
        ebi = getattr(req, "_ebi", 0)
        pre = req.num_computed_tokens if req.status == "running" else 0  # a new request: prefix 0
        if self.cfg.overlap:  # the previous chunk may still be running: one chunk further back
            pre = pre - self.cfg.chunked_prefill_size if ebi >= 2 else None
        if pre is not None:
            ev = getattr(req, "_swa_ev", 0)
            if pre - self.W >= ev + 1:  # eviction_interval 1 on extend (L4125-4129)
                new = (pre - self.W) // self.ps * self.ps
                if new > ev:
                    self.swa.free(new - ev)
                    req._swa_ev = new
        self.pool.alloc(n)
        self.swa.alloc(n)
        req._ebi = ebi + 1

    def _join_running(self, req: SimRequest, held: int) -> None:
        super()._join_running(req, held)
        self.run("ev")[0][-1] = getattr(req, "_swa_ev", 0)

    # -- decode
    def _decode_room(self) -> int:
        return min(self.pool.available + self.pool.evictable, self.swa.available)

    def _decode_alloc(self, active: np.ndarray, need: int) -> None:
        """alloc_for_decode: maybe_evict_swa first, then one slot (page) in each pool."""
        self._evict_windows(active)
        self.pool.alloc(need)
        self.swa.alloc(need)
        self.run("dbi")[0][:] += active

    def _evict_windows(self, active: np.ndarray) -> None:
        """maybe_evict_swa / free_swa_out_of_window_slots (radix off: no prefix sharing)."""
        plen, out, ev, dbi = self.run("plen", "out", "ev", "dbi")
        edge = plen + out - 1 - self.W
        due = active & (dbi >= 1) & (edge >= ev + SWA_EVICTION_INTERVAL)
        if not due.any():
            return
        new = edge // self.ps * self.ps
        freed = np.where(due & (new > ev), new - ev, 0)
        self.swa.free(int(freed.sum()))
        ev[:] = np.where(freed > 0, new, ev)

    def _retract_rooms(self) -> list[int]:
        return [self.pool.available + self.pool.evictable, self.swa.available]

    def _retract_frees(self, row: dict[str, int], req: SimRequest) -> list[int]:
        return [self._private(row, req), self._window_held(row, req)]

    def _window_held(self, row: dict[str, int], req: SimRequest) -> int:
        """Window slots a request holds: its slots above its evicted length (a chunked request
        keeps that on itself, a running one in its lane)."""
        return self.ceil_page(row["held"]) - row.get("ev", getattr(req, "_swa_ev", 0))

    def _release(self, req, row, *, finished, result) -> None:
        self.swa.free(self._window_held(row, req))
        req._swa_ev = req._ebi = 0  # reset_for_retract (schedule_batch.py L2081-2089)
        super()._release(req, row, finished=finished, result=result)

    def plain_steps(self, k_max: int) -> int:
        """No closed form here (windows are freed every 128 tokens per request): closed_loop steps."""
        return 0

    def check_pool(self) -> None:
        super().check_pool()
        L = self.run
        held = sum(self._window_held(L.row(i), L.reqs[i]) for i in range(L.n))
        if self.chunked is not None:
            c = self.chunked
            held += self._window_held({"held": c.num_computed_tokens}, c)
        if self.swa.used != held:
            raise AssertionError(f"window pool leak: {self.swa.used} slots in use, requests hold {held}")

    def refresh_stats(self) -> None:
        """used_tokens / pool_tokens stay the full pool's; the window pool's beside them. The
        engine's gauge sglang:token_usage is the larger of the pools' usages, 2 decimals
        (pool_stats_observer.py L84-100, L150-158); its num_used_tokens is max(full used, window used)."""
        super().refresh_stats()
        if hasattr(self, "swa"):  # (the base __init__ refreshes before the window pool exists)
            s = self.stats
            s.swa_used_tokens, s.swa_pool_tokens = self.swa.used, self.swa.size
            s.usage = round(max(self.pool.used / self.pool.size, self.swa.used / self.swa.size), 2)
