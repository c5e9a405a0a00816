"""SGLang's scheduler (0.5.23, and 0.5.21's new_token_ratio reservation) in virtual time."""

from __future__ import annotations

import numpy as np

from kvprobe.errors import ConfigError
from kvprobe.theory.pools import FullAttention, SglangTokenPool
from kvprobe.theory.sched_common import (
    Emitted,
    Lanes,
    SchedulerBase,
    SglangConfig,
    SimRequest,
    StepResult,
    cdiv,
    output_tokens,
)

# --------------------------------------------------------------------------- SGLang

CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION (schedule_policy.py L89-91)
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS (environ.py)


class SglangScheduler(SchedulerBase):
    """SGLang 0.5.23 scheduler (managers/scheduler.py, schedule_policy.py; sglang.md §2.10).

    Prefill has priority over decode; a pass admits FCFS through `PrefillAdder` until a request
    does not fit (head-of-line), a budget runs out, or max_running_requests is reached; a NO_TOKEN
    latches `batch_full` until a request leaves. Decode out of memory retracts the requests with
    the fewest output tokens. Overlap mode (default) processes a batch's tokens one iteration after
    launching it, so a running request's charge at admission time is P + O instead of P + O - 1.
    """

    def __init__(self, config: SglangConfig):
        super().__init__()
        if config.policy not in ("sglang-0.5.22", "sglang-0.5.21"):
            raise ConfigError(f"unknown SGLang scheduler policy {config.policy!r}")
        self.cfg = config
        self.ps = config.page_size
        self.radix = not config.disable_radix_cache
        self.pool = SglangTokenPool(config.max_total_num_tokens, self.ps)
        self.fp = FullAttention(self.ps)  # pages a request holds (see pools.FullAttention)
        self._req_states: list | None = None  # add_one_req_ignore_eos's per-pass list
        self.run = Lanes(("plen", "out", "pend", "cur", "held", "maxn", "stop", "ign", "seed"))
        self.chunked: SimRequest | None = None  # request between prefill chunks (not in `run`)
        self.batch_full = False
        # NewTokenRatioTracker (new_token_ratio_tracker.py L13-49; env defaults environ.py L646-650)
        self.ratio_init = min(0.7 * config.schedule_conservativeness, 1.0)
        self.ratio_min = min(self.ratio_init * 0.14, 1.0)
        self.ratio_decay = (self.ratio_init - self.ratio_min) / 600
        self.ratio = self.ratio_init
        self.refresh_stats()

    def ceil_page(self, n: int) -> int:
        return cdiv(n, self.ps) * self.ps

    def add(self, req: SimRequest) -> None:
        """init_req_max_new_tokens (scheduler.py L2693-2740): max_new is clipped silently."""
        cfg, P = self.cfg, len(req.prompt)
        max_req_len = min(cfg.context_len - 1, cfg.max_total_num_tokens - 1)
        req._maxn = min(req.max_tokens, max_req_len - P - 1,
                        cfg.max_total_num_tokens - self.ceil_page(P) - self.ps - 1)
        if req._maxn <= 0:
            raise ValueError(f"request {req.rid!r}: prompt of {P} tokens leaves no room to generate")
        stop = req._maxn
        if not req.ignore_eos and req.eos_after is not None:
            stop = min(stop, max(1, req.eos_after))
        req._tokens = tuple(req.prompt)
        self._accept(req, stop)
        self.refresh_stats()

    def step(self) -> StepResult:
        result = StepResult(Emitted(), [], [])
        self.run("cur")[0][:] = 0
        prefilled = False
        if (self.waiting and not self.batch_full) or self.chunked is not None:
            prefilled = self._prefill(result)
        if not prefilled and self.run.n:
            self._decode(result)
        self._process(result)
        if not self.run.n and not self.waiting and self.chunked is None:
            self.ratio = self.ratio_init  # on_idle reset (scheduler.py L5318)
        self.stats.steps += 1
        self.refresh_stats()
        return result

    # -- prefill pass: PrefillAdder (schedule_policy.py L607-1778, prefill_budget.py L62-168)
    def _prefill(self, result: StepResult) -> bool:
        cfg, L, pool, ps = self.cfg, self.run, self.pool, self.ps
        out, maxn, ign = L("out", "maxn", "ign")
        reserve = np.minimum(maxn - out, CLIP_MAX_NEW_TOKENS).astype(float)  # L785-794
        if cfg.policy == "sglang-0.5.22":  # ignore_eos reserved at 1.0 from 0.5.22 on
            reserve *= np.where(ign > 0, 1.0, self.ratio)
        else:
            reserve *= self.ratio
        # available + evictable as the pass began: this model allocates at admission, SGLang after
        # the pass (its current_offset is what b["current"] tracks); locking a matched prefix does
        # take evictable tokens out of _available_and_evictable() for the next candidates
        free = pool.available + pool.evictable
        b = {"total": float(reserve.sum()), "current": 0, "input": cfg.max_prefill_tokens,
             "chunk": cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else None}
        scheduled = 0
        if self.chunked is not None:
            scheduled += self._continue_chunk(free, b, result)
        admitted: list[SimRequest] = []
        self._req_states = None
        room = cfg.max_running_requests - L.n  # get_num_allocatable_reqs (scheduler.py L4027-4050)
        if room <= 0 and self.waiting:
            self.batch_full = True
        while self.waiting and not self.batch_full and self.chunked is None:
            if len(admitted) >= room:
                self.batch_full = True
                break
            req = self.waiting[0]
            P, done = len(req.prompt), req.output_len
            # the tree holds prompts only; a match is capped at len - 1 (_compute_max_prefix_len)
            node, prefix = pool.match(req._tokens, min(P, P + done - 1)) if self.radix else (None, 0)
            ext = P + done - prefix
            max_new = min(max(req._maxn - done, 0), CLIP_MAX_NEW_TOKENS)
            rem_total = free - b["total"] - (pool.evictable_on_path(node) if self.radix else 0)  # prefix locked
            if not self.radix and req.ignore_eos:
                fits = self._ignore_eos_fits(req, ext, free - b["current"], rem_total, admitted)
            else:
                fits = ext + max_new + ps < rem_total  # check_prefill: strict (L114-130)
            if not fits:  # NO_TOKEN: head-of-line, latch
                self.batch_full = bool(admitted) or bool(L.n)
                break
            if b["chunk"] is None and admitted and self.ceil_page(ext) >= b["input"]:
                break
            chunk = ext
            if b["chunk"] is not None and self.ceil_page(ext) > b["chunk"]:
                chunk = b["chunk"] // ps * ps
                if chunk <= 0:
                    break
            self.waiting.popleft()
            if self.radix:
                free -= pool.evictable_on_path(node)
                pool.lock(node)
            req._node, req._cached = node, prefix
            pool.alloc(self.ceil_page(prefix + chunk) - prefix)
            scheduled += chunk
            paged = self.ceil_page(chunk)
            b["current"] += paged + ps
            b["input"] -= paged
            if b["chunk"] is not None:
                b["chunk"] -= paged
            if chunk < ext:  # becomes the chunked request, reserved with max_new 0 (L1675)
                b["total"] += paged + ps
                req.status, req.num_computed_tokens = "running", prefix + chunk
                self.chunked = req
                break
            b["total"] += paged + ps + min(req._maxn, CLIP_MAX_NEW_TOKENS)  # not reduced (L1636)
            self._join_running(req, prefix + chunk)
            admitted.append(req)
            if free - b["total"] <= 0 or free - b["current"] <= 0:
                self.batch_full = True
                break
            if b["input"] <= 0 or (b["chunk"] is not None and b["chunk"] <= 0):
                break
        result.prefill_tokens = scheduled
        return scheduled > 0

    def _continue_chunk(self, free: int, b: dict, result: StepResult) -> int:
        """add_chunked_req (L1140-1222): min(rem_chunk, remaining_total), full chunk if <= 0."""
        req, ps = self.chunked, self.ps
        done = req.num_computed_tokens
        left = len(req.prompt) + req.output_len - done
        size = left
        if b["chunk"] is not None:
            room = min(b["chunk"], int(free - b["total"]))
            size = min(left, room if room > 0 else b["chunk"])
            if size < left:
                size = max(size // ps * ps, ps)
        self.pool.alloc(self.ceil_page(done + size) - self.ceil_page(done))
        paged = self.ceil_page(size)
        b["current"] += paged + ps
        b["input"] -= paged
        if b["chunk"] is not None:
            b["chunk"] -= paged
        if size < left:
            b["total"] += paged + ps
            req.num_computed_tokens = done + size
        else:
            b["total"] += paged + ps + min(req._maxn, CLIP_MAX_NEW_TOKENS)
            self.chunked = None
            self._join_running(req, done + size)
            if self.cfg.max_running_requests - self.run.n <= 0:
                self.batch_full = True
        return size

    def _ignore_eos_fits(self, req, ext, rem_current, rem_total, admitted) -> bool:
        """add_one_req_ignore_eos (schedule_policy.py L1241-1383), the --disable-radix-cache path.

        First check (prefill_budget.py L132-140): the paged prompt alone against the remaining
        budgets, without the candidate's own output. Then a simulation of the future: every
        request's (tokens_left, tokens_occupied), in ascending tokens_left; walking it, `bs`
        requests are still decoding and must each find room for their remaining tokens, helped by
        the tokens of those that finished (L1297-1305, IGNORE_EOS_RESERVE_TOKENS = 1 per request).
        The list is built once per pass (candidate, running, admitted; stable sort, L1280-1288);
        later candidates are insert-sorted before the first entry with tokens_left >= theirs, or
        before the LAST entry when none is (the loop variable's value after an unbroken loop)."""
        ps = self.ps
        paged_input = self.ceil_page(ext) + ps
        if paged_input > min(rem_current, rem_total):
            return False
        mine = self._req_state(req.ignore_eos, req._maxn, req.output_len, len(req.prompt))
        if self._req_states is None:
            out, maxn, ign, plen = self.run("out", "maxn", "ign", "plen")
            states = [mine] + [self._req_state(bool(g), int(m), int(o), int(p))
                               for g, m, o, p in zip(ign.tolist(), maxn.tolist(), out.tolist(), plen.tolist(), strict=True)]
            self._req_states = sorted((x for x in states if x is not None), key=lambda x: x[0])
        elif mine is not None:
            states, i = self._req_states, 0
            for i in range(len(states)):
                if mine[0] <= states[i][0]:
                    break
            states.insert(i, mine)
        cur, freed = rem_current - paged_input, 0
        n = len(self._req_states)
        for i, (left, occupied) in enumerate(self._req_states):
            bs = n - i
            if cur + freed - left * bs <= bs:
                return False
            freed += occupied
        return True

    def _req_state(self, ignore_eos: bool, max_new: int, out: int, plen: int):
        ratio = 1.0 if ignore_eos else self.ratio
        left = max_new * ratio - out
        return (left, plen + out) if left > 0 else None

    def _join_running(self, req: SimRequest, held: int) -> None:
        """Prefill done: the prompt's whole pages are checkpointed into the tree and locked
        (common.py checkpoint_kv_cache L271-281); pages a twin inserted meanwhile are freed as
        duplicates. The request produces its first token with this batch."""
        if self.radix:
            node, already = self.pool.insert(req._tokens, req._node, req._cached)
            self.pool.free(already)
            self.pool.lock(node)
            self.pool.unlock(req._node)
            req._node, req._cached = node, len(req._tokens) // self.ps * self.ps
        req.status = "running"
        self.run.append(req, plen=len(req.prompt), out=req.output_len, cur=1, held=held,
                        maxn=req._maxn, stop=req._stop, ign=int(req.ignore_eos), seed=req._seed)

    # -- decode: update_running_batch (scheduler.py L4459-4552)
    def _decode(self, result: StepResult) -> None:
        L, pool = self.run, self.pool
        out, pend, held = L("out", "pend", "held")
        active = (out + pend < L("stop")[0]) if self.cfg.overlap else np.ones(L.n, bool)
        need = self._decode_need(active, held)
        if need > pool.available + pool.evictable:
            if self.cfg.overlap and not active.all():  # finishing in flight: skip (L4470-4474)
                self.batch_full = False
                return
            self._retract(result)
            out, pend, held = L("out", "pend", "held")
            active = np.ones(L.n, bool)
            need = self._decode_need(active, held)
            if need > pool.available + pool.evictable:
                return
        else:
            self.ratio = max(self.ratio - self.ratio_decay, self.ratio_min)
        pool.alloc(need)
        held += active
        L("cur")[0][:] = active
        result.decode_seqs = int(active.sum())

    # -- event-driven fast path (closed_loop): k plain decode steps in one jump, exactly
    def plain_steps(self, k_max: int) -> int:
        """How many of the next steps are plain decode steps: no prefill is attempted (nothing
        waits, or admission is latched by batch_full), every running request decodes (its token
        known, none finishing in flight), none finishes, and no step runs out of slots. In such
        a stretch only counters move, so `skip(k)` can apply k of them at once."""
        L, pool = self.run, self.pool
        if not L.n or self.chunked is not None or (self.waiting and not self.batch_full):
            return 0
        out, pend, stop, held = L("out", "pend", "stop", "held")
        if self.cfg.overlap and not (pend == 1).all():
            return 0
        k = min(k_max, int((stop - out).min()) - 1)
        if k <= 0:
            return 0
        return self.fp.steps_within(held, (pool.available + pool.evictable) // self.ps, k)

    def skip(self, k: int) -> int:
        """Apply k plain decode steps (k <= plain_steps()); returns the sum over those steps of
        the used-token count sampled after each, as k calls of step() would have seen it."""
        L, pool, ps = self.run, self.pool, self.ps
        held, out = L("held", "out")
        used0 = pool.used
        used_sum = k * used0 + ps * self.fp.allocs_sum(held, k)
        pool.alloc(ps * self.fp.allocs(held, k))
        for _ in range(k):  # the same float operations as k decode steps
            self.ratio = max(self.ratio - self.ratio_decay, self.ratio_min)
        held += k
        out += k
        L("cur")[0][:] = 1
        self.stats.steps += k
        self.refresh_stats()
        return used_sum

    def _decode_need(self, active: np.ndarray, held: np.ndarray) -> int:
        """check_decode_mem (schedule_batch.py L3403-3449): one page per request on a boundary."""
        if self.ps == 1:
            return int(active.sum())
        return int((active & (held % self.ps == 0)).sum()) * self.ps

    def _retract(self, result: StepResult) -> None:
        """retract_decode (schedule_batch.py L3451-3580): fewest outputs first, ties longest prompt,
        until one decode step fits; at least one request stays (aborted if even it cannot fit)."""
        L, pool = self.run, self.pool
        out, plen, held = L("out", "plen", "held")
        keep = np.ones(L.n, bool)
        room = pool.available + pool.evictable
        for i in np.lexsort((-plen, out)).tolist()[:-1]:
            keep[i] = False
            req = L.reqs[i]  # its private slots free, its prompt units become evictable
            room += self._private(L.row(i), req)
            if self.radix:
                room += pool.freed_by_unlock(req._node)
            if self._decode_need(keep, held) <= room:
                break
        victims = [L.reqs[i] for i in np.lexsort((-plen, out)).tolist() if not keep[i]]
        for req in victims:
            i = L.index(req)
            self._release(req, L.row(i), finished=False, result=result)
            L.keep(np.arange(L.n) != i)
            req.status = "waiting"
            req.num_preemptions += 1
            self.waiting.append(req)  # tail of the queue (_add_request_to_queue L3480-3511)
            result.preempted.append(req)
        self.stats.retracted_total += len(victims)
        pool.evict(max(0, RETRACT_DECODE_STEPS * L.n - pool.available))
        out, maxn = L("out", "maxn")
        self.ratio = min(1.0, (float(out.sum()) + RETRACT_DECODE_STEPS * L.n) / (float(maxn.sum()) + 1))
        if self._decode_need(np.ones(L.n, bool), L("held")[0]) > pool.available + pool.evictable:
            last = L.reqs[0]  # "Out of memory even after retracting all other requests"
            self._release(last, L.row(0), finished=False, result=result)
            L.keep(np.zeros(L.n, bool))
            last.status, last.finish_reason = "aborted", "abort"
            del self.requests[last.rid]
            result.finished.append(last)

    # -- result processing (batch_result_processor.py): overlap processes the previous batch
    def _process(self, result: StepResult) -> None:
        L = self.run
        if not L.n:
            return
        out, pend, cur, stop, seed = L("out", "pend", "cur", "stop", "seed")
        got = pend.copy() if self.cfg.overlap else cur.copy()
        out += got
        if self.cfg.overlap:
            pend[:] = cur
        idx = np.flatnonzero(got)
        result.emitted = Emitted(L.reqs[idx], seed[idx], out[idx] - 1)
        done = np.flatnonzero((got > 0) & (out >= stop))
        if len(done):
            for i in done.tolist():
                req = L.reqs[i]
                self._release(req, L.row(i), finished=True, result=result)
                req.status, req.finish_reason = "finished", self._finish_reason(req)
                del self.requests[req.rid]
                result.finished.append(req)
            mask = np.ones(L.n, bool)
            mask[done] = False
            L.keep(mask)
            self.batch_full = False  # a request left the running batch (L3948-3968)

    def _private(self, row: dict[str, int], req: SimRequest) -> int:
        return self.ceil_page(row["held"]) - req._cached

    def _release(self, req: SimRequest, row: dict[str, int], *, finished: bool, result: StepResult) -> None:
        """Finished: the whole sequence (P + O - 1 tokens) enters the tree unlocked, i.e. evictable
        (common.py release_kv_cache L400-444). Retracted/aborted: private KV is freed, the prompt
        is unlocked (release_req L2360-2395)."""
        pool = self.pool
        req.output_len = row["out"]
        if not finished and row["pend"]:  # an in-flight token of a retracted request is kept
            req.output_len += row["pend"]
            result.emitted._extra.append((req, int(output_tokens(np.int64(row["seed"]), req.output_len - 1))))
        req.num_computed_tokens = 0
        private = self._private(row, req)
        if finished and self.radix:  # the prompt is in the tree already; the rest is one leaf
            pool.insert_leaf(req._node, ("leaf", req.rid, req.num_preemptions), private)
        else:
            pool.free(private)
        if self.radix:
            pool.unlock(req._node)
        req._node, req._cached = None, 0

    def _abort_running(self, req: SimRequest) -> None:
        dummy = StepResult(Emitted(), [], [])
        if req is self.chunked:
            held = req.num_computed_tokens
            self._release(req, {"held": held, "out": req.output_len, "pend": 0, "seed": req._seed},
                          finished=False, result=dummy)
            self.chunked = None
            return
        i = self.run.index(req)
        self._release(req, self.run.row(i), finished=False, result=dummy)
        self.run.keep(np.arange(self.run.n) != i)
        self.batch_full = False

    def has_work(self) -> bool:
        return bool(self.run.n or self.waiting or self.chunked is not None)

    def sync(self) -> None:
        L = self.run
        out, held = L("out", "held")
        for i in range(L.n):
            L.reqs[i].output_len = int(out[i])
            L.reqs[i].num_computed_tokens = int(held[i])

    def check_pool(self) -> None:
        L = self.run
        private = sum(self._private(L.row(i), L.reqs[i]) for i in range(L.n))
        if self.chunked is not None:
            c = self.chunked
            private += self.ceil_page(c.num_computed_tokens) - c._cached
        self.pool.check(private)

    def refresh_stats(self) -> None:
        s, pool = self.stats, self.pool
        s.running, s.waiting = self.run.n, len(self.waiting)
        s.waiting_capacity = s.waiting
        s.usage = pool.token_usage
        s.used_tokens = pool.used
        s.pool_tokens = pool.size
        s.new_token_ratio = self.ratio
        s.preemptions_total = s.retracted_total
