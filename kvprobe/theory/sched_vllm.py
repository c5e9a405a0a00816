"""vLLM V1's scheduler (0.33.0, and 0.11's first-chunk admission) in virtual time."""

from __future__ import annotations

import numpy as np

from kvprobe.errors import ConfigError
from kvprobe.theory.pools import FullAttention, VllmBlockPool, prompt_keys
from kvprobe.theory.sched_common import (
    Emitted,
    Lanes,
    SchedulerBase,
    SimRequest,
    StepResult,
    VllmConfig,
    output_tokens,
)

# --------------------------------------------------------------------------- vLLM


class VllmScheduler(SchedulerBase):
    """vLLM V1 `Scheduler.schedule()` + `update_from_output()` (v1/core/sched/scheduler.py, 0.33.0).

    One `step()` is one `EngineCore` step. Synchronous (`step`, core.py): schedule a batch, run it,
    `update_from_output` of that batch. Async scheduling (`AsyncScheduler` with a batch queue of 2,
    `step_with_batch_queue` core.py L708-822): schedule batch t, then process the output of batch
    t-1. A decode is scheduled before the token it feeds is known: `num_output_placeholders`
    counts the in-flight token (async_scheduler.py L24-56) and `num_new_tokens = num_tokens +
    placeholders - num_computed` (scheduler.py L839-843), so each slot is allocated one step
    earlier; a finished request is found, and its blocks freed, one step later; a request sure to
    have reached max_tokens is not scheduled again (L800-814). A request preempted with a token in
    flight still receives it (the stale share, `_preempt_request` L1820-1836).
    """

    memo = True  # remember a head that cannot be admitted (tests compare with it off)

    def __init__(self, config: VllmConfig):
        super().__init__()
        if config.policy not in ("vllm-0.33", "vllm-0.11"):
            raise ConfigError(f"unknown vLLM scheduler policy {config.policy!r}")
        if config.max_num_batched_tokens < config.max_num_seqs:  # config/scheduler.py L317-336
            raise ConfigError("max_num_batched_tokens must be >= max_num_seqs")
        if config.num_gpu_blocks < 2:
            raise ConfigError("num_gpu_blocks must be >= 2 (block 0 is the null block)")
        self.cfg = config
        self.B = config.block_size
        self.pool = VllmBlockPool(config.num_gpu_blocks)
        self.fp = FullAttention(self.B)  # blocks a request holds (see pools.FullAttention)
        self.async_ = config.async_scheduling
        # ph: output placeholders (async); fly: sampled by the previous batch, output not processed
        self.run = Lanes(("comp", "ntok", "held", "stop", "plen", "sched", "seed", "cap", "ph", "fly"))
        self._stale: list[SimRequest] = []
        self._head_memo: tuple | None = None  # (head, its tokens, budget, watermark), free, pool.added
        self.full_isl = config.policy == "vllm-0.33"  # --scheduler-reserve-full-isl, absent in 0.11
        self.watermark = int(config.watermark * config.num_gpu_blocks) if self.full_isl else 0
        self.refresh_stats()

    def add(self, req: SimRequest) -> None:
        P, mml = len(req.prompt), self.cfg.max_model_len
        if P >= mml:
            raise ValueError(f"request {req.rid!r}: prompt of {P} tokens >= max_model_len {mml}")
        stop = min(P + req.max_tokens, mml)  # utils.py check_stop: max_tokens or max_model_len
        if not req.ignore_eos and req.eos_after is not None:
            stop = min(stop, P + max(1, req.eos_after))
        if self.cfg.enable_prefix_caching:
            req._pkeys = prompt_keys(req.prompt, self.B)
        self._accept(req, stop)
        self.refresh_stats()

    # -- one engine step
    def step(self) -> StepResult:
        result = StepResult(Emitted(), [], [])
        budget = self.cfg.max_num_batched_tokens
        budget = self._schedule_running(budget, result)
        if not result.preempted:  # no admission in a step that preempted (L1050)
            self._schedule_waiting(budget)
        self._after_schedule(result)
        self.stats.steps += 1
        self.refresh_stats()
        return result

    def _after_schedule(self, result: StepResult) -> None:
        """_update_after_schedule (L1845-1877): a request scheduled up to the end of its known
        sequence samples a token (async: one more placeholder). Sync processes this batch's output
        now; async processes the previous batch's."""
        L = self.run
        comp, ntok, sched, ph, fly, plen = L("comp", "ntok", "sched", "ph", "fly", "plen")
        decoding = (sched > 0) & (comp - sched >= plen)
        result.decode_seqs = int(decoding.sum())
        result.prefill_tokens = int(sched.sum()) - result.decode_seqs
        samples = (sched > 0) & (comp >= ntok + ph)
        if self.async_:
            ph += samples
            previous = fly.astype(bool)
            fly[:] = samples
        else:
            previous = samples
        sched[:] = 0
        self._update_from_output(result, previous)

    def _schedule_running(self, budget: int, result: StepResult) -> int:
        """RUNNING loop (L794-1034): decode 1 token / chunked-prefill the rest within the budget;
        on allocation failure preempt the LAST running request and retry (L930-994)."""
        L, pool = self.run, self.pool
        if not L.n:
            return budget
        comp, ntok, held, sched, plen, cap, ph = L("comp", "ntok", "held", "sched", "plen", "cap", "ph")
        need = np.minimum(ntok + ph - comp, self.cfg.max_model_len - comp - 1)  # L839-857
        need[(ph > 0) & (comp + 2 - ph >= cap)] = 0  # async: surely finished, not scheduled (L800-814)
        np.maximum(need, 0, out=need)
        np.clip(budget - (np.cumsum(need) - need), 0, need, out=sched)
        new_blocks = np.maximum(self.fp.blocks(comp + sched) - held, 0)
        cum = np.cumsum(new_blocks)
        if cum[-1] <= pool.num_free:  # everyone fits: the common case, fully vectorised
            pool.take(int(cum[-1]))
            held += new_blocks
        else:
            i = 0
            while i < L.n:  # vectorised up to the next request that fails, then preempt for it
                part = new_blocks[i : L.n]
                cum = np.cumsum(part)
                k = i + int(np.searchsorted(cum, pool.num_free, side="right"))
                pool.take(int(cum[k - i - 1]) if k > i else 0)
                held[i:k] += part[: k - i]
                if k >= L.n:
                    break
                while new_blocks[k] > pool.num_free:
                    victim = L.n - 1
                    result.preempted.append(self._preempt_last())
                    if victim == k:
                        break
                else:
                    pool.take(int(new_blocks[k]))
                    held[k] += new_blocks[k]
                    i = k + 1
                    continue
                break  # the request preempted itself: nothing after it is left
            comp, sched, plen = L("comp", "sched", "plen")
        prefilling = np.flatnonzero((comp < plen) & (sched > 0))
        comp += sched
        for i in prefilling.tolist():
            self._cache_prompt_blocks(L.reqs[i], int(comp[i]))
        return budget - int(sched.sum())

    def _head_admission(self, free: int, budget: int):
        """What admitting the head of the queue takes, or None if it cannot be admitted now: the
        checks of one pass of the WAITING loop (L1049-1600) and `allocate_slots` (kv_cache_manager.py
        L518-588), with no side effect. Returns (hits, new tokens, fresh blocks, num_tokens)."""
        cfg = self.cfg
        req = self.waiting[0]
        num_tokens = len(req.prompt) + req.output_len
        wm = self.watermark if self.run.n else 0
        # The same head failed with at least as many free blocks and no key was cached since: it
        # fails again (evictions and releases only raise its need; only its own admission touches).
        # 0.11's chunk check is the exception (an eviction can lower it), so it is never memoised.
        key = (req, num_tokens, budget, wm)
        memo = self._head_memo
        if self.memo and memo is not None and memo[0] == key and free <= memo[1] and self.pool.added == memo[2]:
            return None
        result = self._head_check(req, num_tokens, free, budget, wm)
        if result is None and (self.full_isl or not cfg.enable_prefix_caching):
            self._head_memo = (key, free, self.pool.added)
        return result

    def _head_check(self, req: SimRequest, num_tokens: int, free: int, budget: int, wm: int):
        cfg, B = self.cfg, self.B
        hits = self._lookup(req, num_tokens) if cfg.enable_prefix_caching else []
        h, hit_free = len(hits), sum(1 for key in hits if key in self.pool.lru)
        new = num_tokens - h * B
        if not cfg.enable_chunked_prefill and new > budget:
            return None
        new = min(new, budget)
        # watermark only when something runs; evictable hits still consume free-queue entries
        # (single_type_kv_cache_manager L238-265)
        if self.full_isl and self.fp.blocks(min(num_tokens, cfg.max_model_len)) - h + hit_free + wm > free:
            return None
        fresh = self.fp.blocks(h * B + new) - h
        if fresh + hit_free + wm > free:
            return None
        return hits, new, fresh, num_tokens

    def _schedule_waiting(self, budget: int) -> None:
        """WAITING loop (L1049-1600): FCFS, head-of-line blocking, full-sequence-must-fit (0.33)."""
        cfg, L, pool, B = self.cfg, self.run, self.pool, self.B
        while self.waiting and budget > 0:
            if L.n >= cfg.max_num_seqs:
                break
            admission = self._head_admission(pool.num_free, budget)
            if admission is None:
                break
            hits, new, fresh, num_tokens = admission
            req = self.waiting.popleft()
            P, h = len(req.prompt), len(hits)
            pool.touch(hits)
            pool.take(fresh)
            req._keys = list(hits)
            if cfg.enable_prefix_caching:
                self.stats.prefix_queries_total += num_tokens
                self.stats.prefix_hits_total += h * B
            comp = h * B + new
            self._cache_prompt_blocks(req, comp)
            req.status = "running"
            L.append(req, comp=comp, ntok=num_tokens, held=h + fresh, stop=req._stop, plen=P,
                     sched=new, seed=req._seed, cap=P + req.max_tokens)
            budget -= new

    # -- event-driven fast path (closed_loop): k plain decode steps in one jump, exactly
    def plain_steps(self, k_max: int) -> int:
        """How many of the next steps are plain decode steps: every running request decodes one
        token within the budget, none finishes, no step runs out of blocks (so none preempts),
        and the head of the queue cannot be admitted. Free blocks only fall and the head's need
        only grows in such a stretch (an eviction can only cut its prefix hits), so a head that
        does not fit at its first step fits at none. `skip(k)` then applies k of them at once."""
        L, cfg = self.run, self.cfg
        n = L.n
        if not n or n > cfg.max_num_batched_tokens:
            return 0
        comp, ntok, held, stop, cap, ph, fly = L("comp", "ntok", "held", "stop", "cap", "ph", "fly")
        if self.async_:
            if not ((ph == 1).all() and (fly == 1).all() and (comp == ntok).all()):
                return 0
        elif not (ntok - comp == 1).all():
            return 0
        if not (held == self.fp.blocks(comp)).all():
            return 0
        k = min(k_max, int((stop - ntok).min()) - 1, int((cap - comp).min()) - 1,
                cfg.max_model_len - int(comp.max()) - 1)
        if k <= 0:
            return 0
        free = self.pool.num_free
        if self.waiting and n < cfg.max_num_seqs and cfg.max_num_batched_tokens - n > 0:
            if not self.full_isl and cfg.enable_prefix_caching:
                return 0  # 0.11's chunk check could start to fit as evictions cut free hits
            if self._head_admission(free - self.fp.allocs(comp, 1), cfg.max_num_batched_tokens - n) is not None:
                return 0
        return self.fp.steps_within(comp, free, k)

    def skip(self, k: int) -> int:
        """Apply k plain decode steps (k <= plain_steps()); returns the sum over those steps of
        the used tokens sampled after each (stats.used_tokens), as k step() calls would see it."""
        L, pool, B = self.run, self.pool, self.B
        comp, ntok, held = L("comp", "ntok", "held")
        used0 = pool.usable - pool.num_free
        used_sum = k * used0 + self.fp.allocs_sum(comp, k)
        pool.take(self.fp.allocs(comp, k))
        comp += k
        ntok += k
        held[:] = self.fp.blocks(comp)
        self.stats.steps += k
        self.refresh_stats()
        return used_sum * B

    def _update_from_output(self, result: StepResult, sampled: np.ndarray) -> None:
        """update_from_output (L2259-2676): append the token of every request that sampled one;
        finish on max_tokens / max_model_len / eos and free its blocks in the same call."""
        L = self.run
        if L.n:
            ntok, ph, plen, stop, seed = L("ntok", "ph", "plen", "stop", "seed")
            idx = np.flatnonzero(sampled)
            ntok[idx] += 1
            if self.async_:
                ph[idx] -= 1
            result.emitted = Emitted(L.reqs[idx], seed[idx], ntok[idx] - plen[idx] - 1)
            done = np.flatnonzero(sampled & (ntok >= stop))
            if len(done):
                for i in done.tolist():
                    req = L.reqs[i]
                    self._leave(req, L.row(i), "finished")
                    self._finish(req, result)
                mask = np.ones(L.n, bool)
                mask[done] = False
                L.keep(mask)
        for req in self._stale:  # a preempted request's in-flight token is still delivered
            req.output_len += 1
            result.emitted._extra.append((req, int(output_tokens(np.int64(req._seed), req.output_len - 1))))
            if len(req.prompt) + req.output_len >= req._stop and req.rid in self.requests:
                self.waiting.remove(req)  # stopped while preempted (stopped_preempted_reqs)
                self._finish(req, result)
        self._stale.clear()

    def _finish(self, req: SimRequest, result: StepResult) -> None:
        req.status, req.finish_reason = "finished", self._finish_reason(req)
        del self.requests[req.rid]
        result.finished.append(req)

    # -- events
    def _preempt_last(self) -> SimRequest:
        """_preempt_request (L1799-1843): free all blocks, num_computed = 0, front of waiting."""
        L = self.run
        req = L.reqs[L.n - 1]
        row = L.row(L.n - 1)
        self._leave(req, row, "preempted")
        L.keep(np.arange(L.n) < L.n - 1)
        if row["fly"]:
            self._stale.append(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.stats.preemptions_total += 1
        return req

    def _abort_running(self, req: SimRequest) -> None:
        i = self.run.index(req)
        self._leave(req, self.run.row(i), "aborted")
        self.run.keep(np.arange(self.run.n) != i)

    def _leave(self, req: SimRequest, row: dict[str, int], status: str) -> None:
        """Write the lane back to the request and free its blocks. Full computed blocks get their
        hash now (vLLM hashed them when they filled; nobody else could have hit them meanwhile)."""
        req.output_len = row["ntok"] - row["plen"]
        req.num_computed_tokens = row["comp"]
        req.status = status
        keys, full, dead = req._keys, (row["comp"] - row["ph"]) // self.B, 0  # in-flight KV not cached
        if self.cfg.enable_prefix_caching:
            # a preempted request can hit its own blocks on resume; a finished one's output
            # blocks can never be hit again (their keys name its rid), so they free as a dead run
            upto = full if status == "preempted" else min(full, len(req._pkeys))
            while len(keys) < upto and self.pool.cache(self._block_key(req, len(keys))):
                keys.append(self._block_key(req, len(keys)))
            dead = full - len(keys)
        self.pool.release(keys, row["held"] - len(keys) - dead, dead)
        req._keys = []

    # -- prefix caching
    def _block_key(self, req: SimRequest, k: int):
        return req._pkeys[k] if k < len(req._pkeys) else ("o", req.rid, k)

    def _lookup(self, req: SimRequest, num_tokens: int) -> list:
        """Longest cached prefix, capped at num_tokens - 1 tokens in whole blocks (L295-302)."""
        refs, lru, pkeys = self.pool.refs, self.pool.lru, req._pkeys
        hits = []
        for k in range((num_tokens - 1) // self.B):
            key = pkeys[k] if k < len(pkeys) else ("o", req.rid, k)
            if key not in refs and key not in lru:
                break
            hits.append(key)
        return hits

    def _cache_prompt_blocks(self, req: SimRequest, computed: int) -> None:
        """cache_blocks at allocation time (kv_cache_manager.py L624): full prompt blocks get keys."""
        if not self.cfg.enable_prefix_caching:
            return
        keys, upto = req._keys, min(computed, len(req.prompt)) // self.B
        while len(keys) < upto and self.pool.cache(req._pkeys[len(keys)]):
            keys.append(req._pkeys[len(keys)])

    # -- observation
    def sync(self) -> None:
        """Refresh output_len / num_computed_tokens of running requests (O(running))."""
        L = self.run
        comp, ntok, plen = L("comp", "ntok", "plen")
        for i in range(L.n):
            L.reqs[i].output_len = int(ntok[i] - plen[i])
            L.reqs[i].num_computed_tokens = int(comp[i])

    def check_pool(self) -> None:
        """Raise AssertionError if blocks leaked (used by tests and the emulator's drain check)."""
        held = self.run("held")[0]
        keys = sum(len(self.run.reqs[i]._keys) for i in range(self.run.n))
        self.pool.check(int(held.sum()) - keys)

    def refresh_stats(self) -> None:
        s, pool, B = self.stats, self.pool, self.B
        s.running, s.waiting = self.run.n, len(self.waiting)
        s.waiting_capacity = s.waiting
        s.usage = pool.usage
        s.used_tokens = (pool.usable - pool.num_free) * B
        s.pool_tokens = pool.usable * B
