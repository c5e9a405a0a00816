"""vLLM V1's scheduler (0.33.0, and 0.11's first-chunk admission) in virtual time."""

from __future__ import annotations

import numpy as np

from kvprobe.errors import ConfigError
from kvprobe.theory.sim.core import (
    Emitted,
    Lanes,
    SchedulerBase,
    SimRequest,
    StepResult,
    VllmConfig,
    output_tokens,
)
from kvprobe.theory.sim.pools import FullAttention, prompt_keys
from kvprobe.theory.vllm.block_pool import VllmBlockPool
from kvprobe.theory.vllm.fastpath import VllmFastPath

# --------------------------------------------------------------------------- vLLM


class VllmScheduler(VllmFastPath, SchedulerBase):
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
        self._plain = False  # known to be in the state plain_steps checks (set by the fast path only)
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
        self._plain, self._horizon = False, None
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
        scheduled = sched > 0
        result.decode_seqs = int(np.count_nonzero(scheduled & (comp - sched >= plen)))
        result.prefill_tokens = int(sched.sum()) - result.decode_seqs
        samples = scheduled & (comp >= ntok + ph)
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
        L = self.run
        if not L.n:
            return budget
        comp, ntok, held, sched, plen, cap, ph = L("comp", "ntok", "held", "sched", "plen", "cap", "ph")
        need = ntok + ph - comp
        np.minimum(need, self.cfg.max_model_len - 1 - comp, out=need)  # L839-857
        if self.async_:
            need[(ph > 0) & (comp + 2 - ph >= cap)] = 0  # surely finished, not scheduled (L800-814)
        np.maximum(need, 0, out=need)
        before = need.cumsum()
        if before[-1] <= budget:  # the budget covers everyone
            sched[:] = need
        else:  # FCFS within the budget: what is left of it after the requests ahead
            before -= need
            np.minimum(need, np.maximum(budget - before, 0), out=sched)
        if self._allocate(np.maximum(self.fp.blocks(comp + sched) - held, 0), result):
            comp, sched, plen = L("comp", "sched", "plen")
        prefilling = ((comp < plen) & (sched > 0)).nonzero()[0]
        comp += sched
        for i in prefilling.tolist():
            self._cache_prompt_blocks(L.reqs[i], int(comp[i]))
        return budget - int(sched.sum())

    def _allocate(self, new_blocks: np.ndarray, result: StepResult) -> bool:
        """Give the running requests their new blocks in running order; when the pool runs dry,
        preempt the LAST running request and retry (L930-994). True if anyone was preempted."""
        L, pool = self.run, self.pool
        held = L("held")[0]
        cum = new_blocks.cumsum()
        if cum[-1] <= pool.num_free:  # everyone fits: the common case, fully vectorised
            pool.take(int(cum[-1]))
            held += new_blocks
            return False
        i = 0
        while i < L.n:  # vectorised up to the next request that fails, then preempt for it
            part = new_blocks[i : L.n]
            cum = part.cumsum()
            k = i + int(cum.searchsorted(pool.num_free, side="right"))
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
        return bool(result.preempted)

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
        hits, own, free_hits = self._lookup(req, num_tokens) if cfg.enable_prefix_caching else ([], 0, 0)
        h, hit_free = len(hits) + own, own + free_hits  # own hits are all free
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
        return hits, own, new, fresh, num_tokens

    def _schedule_waiting(self, budget: int) -> None:
        """WAITING loop (L1049-1600): FCFS, head-of-line blocking, full-sequence-must-fit (0.33)."""
        cfg, L, pool, B = self.cfg, self.run, self.pool, self.B
        while self.waiting and budget > 0:
            if L.n >= cfg.max_num_seqs:
                break
            admission = self._head_admission(pool.num_free, budget)
            if admission is None:
                break
            hits, own, new, fresh, num_tokens = admission
            req = self.waiting.popleft()
            P, h = len(req.prompt), len(hits) + own
            pool.touch(hits)
            if own:
                req._runs = pool.touch_own(req._runs, len(req._pkeys), own)
            pool.take(fresh)
            req._keys, req._own = list(hits), own
            if cfg.enable_prefix_caching:
                self.stats.prefix_queries_total += num_tokens
                self.stats.prefix_hits_total += h * B
            comp = h * B + new
            self._cache_prompt_blocks(req, comp)
            req.status = "running"
            L.append(req, comp=comp, ntok=num_tokens, held=h + fresh, stop=req._stop, plen=P,
                     sched=new, seed=req._seed, cap=P + req.max_tokens)
            budget -= new

    def _update_from_output(self, result: StepResult, sampled: np.ndarray) -> None:
        """update_from_output (L2259-2676): append the token of every request that sampled one;
        finish on max_tokens / max_model_len / eos and free its blocks in the same call."""
        L = self.run
        if L.n:
            ntok, ph, plen, stop, seed = L("ntok", "ph", "plen", "stop", "seed")
            idx = sampled.nonzero()[0]
            ntok[idx] += 1
            if self.async_:
                ph[idx] -= 1
            result.emitted = Emitted(L.reqs[idx], seed[idx], ntok[idx] - plen[idx] - 1)
            done = (sampled & (ntok >= stop)).nonzero()[0]
            if len(done):
                for i in done.tolist():
                    req = L.reqs[i]
                    self._leave(req, L.row(i), "finished")
                    self._finish(req, result)
                mask = np.ones(L.n, bool)
                mask[done] = False
                L.keep(mask)
        self._deliver_stale(result)

    def _deliver_stale(self, result: StepResult, emit: bool = True) -> None:
        for req in self._stale:  # a preempted request's in-flight token is still delivered
            req.output_len += 1
            if emit:
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
        L.pop()
        if row["fly"]:
            self._stale.append(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.stats.preemptions_total += 1
        return req

    def _abort_running(self, req: SimRequest) -> None:
        self._plain, self._horizon = False, None
        i = self.run.index(req)
        self._leave(req, self.run.row(i), "aborted")
        self.run.keep(np.arange(self.run.n) != i)

    def _leave(self, req: SimRequest, row: dict[str, int], status: str) -> None:
        """Write the lane back to the request and free its blocks. Full computed blocks get their
        hash now (vLLM hashed them when they filled; nobody else could have hit them meanwhile)."""
        req.output_len = row["ntok"] - row["plen"]
        req.num_computed_tokens = row["comp"]
        req.status = status
        pool, keys, held_own = self.pool, req._keys, req._own
        if not self.cfg.enable_prefix_caching:
            pool.release(keys, row["held"])
            return
        # Full blocks are hashed (vLLM hashed them as they filled; nobody else could hit them
        # meanwhile), in block order up to the first whose hash is already cached (that one and
        # the rest stay unhittable: "dead"). A preempted request can hit its own blocks on resume;
        # a finished one's output blocks can never be hit again, so they free as a dead run.
        full, npk = (row["comp"] - row["ph"]) // self.B, len(req._pkeys)  # in-flight KV not cached
        upto = full if status == "preempted" else min(full, npk)
        n = len(keys)
        if n < min(upto, npk):
            n = pool.cache_keys(req._pkeys, n, min(upto, npk))
            keys.extend(req._pkeys[len(keys):n])
        own = held_own
        if n == npk and upto > npk + own:
            own = pool.own_limit(req._runs, npk + own, upto) - npk
        dead = full - len(keys) - own
        run = pool.release(keys, row["held"] - len(keys) - own - dead, dead=dead, own=own, own_lo=npk,
                           held_own=held_own, owned=status == "preempted")
        req._keys, req._own = [], 0
        live = [r for r in req._runs if r in pool.lru] if status == "preempted" else []
        req._runs = live + [run] if run is not None else live

    # -- prefix caching
    def _lookup(self, req: SimRequest, num_tokens: int) -> tuple[list, int, int]:
        """Longest cached prefix, capped at num_tokens - 1 tokens in whole blocks (L295-302): its
        prompt keys, how many of the request's own blocks follow them, and how many of the prompt
        keys are free."""
        cap, pkeys = (num_tokens - 1) // self.B, req._pkeys
        n, free = self.pool.prompt_hits(pkeys, cap)
        own = 0
        if n == len(pkeys) and cap > n and req._runs:
            own = min(self.pool.own_cached(req._runs, n), cap - n)
        return pkeys[:n], own, free

    def _cache_prompt_blocks(self, req: SimRequest, computed: int) -> None:
        """cache_blocks at allocation time (kv_cache_manager.py L624): full prompt blocks get keys."""
        if not self.cfg.enable_prefix_caching:
            return
        keys, upto = req._keys, min(computed, len(req.prompt)) // self.B
        if len(keys) < upto:
            keys.extend(req._pkeys[len(keys):self.pool.cache_keys(req._pkeys, len(keys), upto)])

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
        keys = sum(len(self.run.reqs[i]._keys) + self.run.reqs[i]._own for i in range(self.run.n))
        self.pool.check(int(held.sum()) - keys)

    def refresh_stats(self) -> None:
        s, pool, B = self.stats, self.pool, self.B
        s.running, s.waiting = self.run.n, len(self.waiting)
        s.waiting_capacity = s.waiting
        s.usage = pool.usage
        s.used_tokens = (pool.usable - pool.num_free) * B
        s.pool_tokens = pool.usable * B
