"""SGLang 0.5.23's prefill pass as the simulated scheduler runs it: `PrefillAdder`
(managers/schedule_policy.py L607-1778, mem_cache/prefill_budget.py L62-168) on top of the
scheduler's state; mixed into SglangScheduler (sglang/scheduler.py)."""

from __future__ import annotations

import numpy as np

from kvprobe.theory.sim.core import SimRequest, StepResult

CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION (schedule_policy.py L89-91)


class SglangPrefillAdder:
    """One prefill pass: FCFS admission within the token budgets, the chunked request first."""

    def _prefill(self, result: StepResult) -> bool:
        cfg, L, pool, ps = self.cfg, self.run, self.pool, self.ps
        out, maxn, ign = L("out", "maxn", "ign")
        reserve = np.minimum(maxn - out, CLIP_MAX_NEW_TOKENS).astype(float)  # L785-794
        reserve *= self._reserve_ratios(ign)
        linger = self._lingering_reserve()
        # available + evictable as the pass began: this model allocates at admission, SGLang after
        # the pass (its current_offset is what b["current"] tracks); locking a matched prefix does
        # take evictable tokens out of _available_and_evictable() for the next candidates
        free = pool.available + pool.evictable
        b = {"total": float(reserve.sum()) + linger, "current": 0, "input": cfg.max_prefill_tokens,
             "chunk": cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else None}
        scheduled, running = 0, L.n + len(self.lingering)  # finished ones still in the batch count (<= 0.5.22)
        self._swa_pass_start()
        if self.chunked is not None:
            scheduled += self._continue_chunk(free, b, result)
        admitted: list[SimRequest] = []
        self._req_states = None
        room = cfg.max_running_requests - running  # get_num_allocatable_reqs (scheduler.py L4027-4050)
        if room <= 0 and self.waiting:
            self.batch_full = True
        while self.waiting and not self.batch_full and self.chunked is None:
            if len(admitted) >= room:
                self.batch_full = True
                break
            req = self.waiting[0]
            P, done = len(req.prompt), req.output_len
            # prompt and outputs so far (a retracted request's); a match is capped at len - 1
            # (_compute_max_prefix_len)
            node, prefix = self._match(req, P + done - 1) if self.radix else (None, 0)
            ext = P + done - prefix
            max_new = min(max(req._maxn - done, 0), CLIP_MAX_NEW_TOKENS)
            rem_total = free - b["total"] - (pool.evictable_on_path(node) if self.radix else 0)  # prefix locked
            chunk_limit = b["chunk"]
            if not self.radix and req.ignore_eos:
                fits = self._ignore_eos_fits(req, ext, free - b["current"], rem_total, admitted)
                fits = fits and self._swa_fits_ignore_eos(ext, max_new, chunk_limit)
            else:
                fits = ext + max_new + ps < rem_total  # check_prefill: strict (L114-130)
                if fits:
                    fits, chunk_limit = self._swa_check_prefill(ext, max_new, chunk_limit)
            if not fits:  # NO_TOKEN: head-of-line, latch
                self.stats.no_token_total += 1
                self.batch_full = bool(admitted) or bool(L.n)
                break
            if b["chunk"] is None and admitted and self.ceil_page(ext) >= b["input"]:
                break
            chunk = ext
            if chunk_limit is not None and self.ceil_page(ext) > chunk_limit:
                chunk = chunk_limit // ps * ps
                if chunk <= 0:
                    break
            self.waiting.popleft()
            if self.radix:
                free -= pool.evictable_on_path(node)
                pool.lock(node)
            req._node, req._cached = node, prefix
            self._alloc_extend(self.ceil_page(prefix + chunk) - prefix, req)
            scheduled += chunk
            paged = self.ceil_page(chunk)
            self._swa_reserve(paged, 0 if chunk < ext else min(req._maxn, CLIP_MAX_NEW_TOKENS), b["chunk"])
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
            if free - b["total"] <= 0 or free - b["current"] <= 0 or self._swa_left() <= 0:
                self.batch_full = True
                break
            if b["input"] <= 0 or (b["chunk"] is not None and b["chunk"] <= 0):
                break
        if not running:  # the latch was set on an empty running batch, which the next step replaces
            self.batch_full = False  # with the prefill batch (scheduler.py L3940-3960) or resets (L4094-4097)
        result.prefill_tokens = scheduled
        return scheduled > 0

    def _lingering_reserve(self) -> float:
        """What the finished requests still in the running batch (releases up to 0.5.22) add to the
        pass's reserve: `_get_running_request_total_token_offset` over running_batch.reqs (0.5.19
        schedule_policy.py L530-536, L630-637) counts them too; a request finished by length adds 0,
        one finished by EOS its max_new_tokens left, at the ratio its policy reserves it with."""
        if not self.lingering:
            return 0.0
        ratios = self._reserve_ratios(np.array([ign for _, ign in self.lingering]))
        return float(sum(rest * ratio for (rest, _), ratio in zip(self.lingering, ratios, strict=True)))

    def _reserve_ratios(self, ign: np.ndarray) -> np.ndarray:
        """The share of its remaining output each request reserves: new_token_ratio, and the whole of it
        for an ignore_eos request from 0.5.22 on (the release's policy)."""
        if self.cfg.policy == "sglang-0.5.22":
            return np.where(ign > 0, 1.0, self.ratio)
        return np.full(len(ign), self.ratio)

    def _match(self, req: SimRequest, limit: int):
        """The longest cached prefix of the request's tokens (tree node, tokens)."""
        return self.pool.match(self._fill(req), limit)

    def _continue_chunk(self, free: int, b: dict, result: StepResult) -> int:
        """add_chunked_req (L1140-1222): min(rem_chunk, remaining_total), full chunk if <= 0. Unlike a
        first chunk (L1663-1671) a continuation is not floored to a page: it may end mid-page."""
        req, ps = self.chunked, self.ps
        done = req.num_computed_tokens
        left = len(req.prompt) + req.output_len - done
        size = left
        if b["chunk"] is not None:
            room = min(b["chunk"], int(free - b["total"]))
            if self._swa_left() != float("inf"):  # SWAPrefillBudget.available_chunk_tokens: parked
                room = min(room, int(self._swa_left()) - ps)  # when no window room (L325-329)
                if room <= 0:
                    return 0
            size = min(left, room if room > 0 else b["chunk"])  # not floored to a page (L1181-1184)
        self._alloc_extend(self.ceil_page(done + size) - self.ceil_page(done), req)
        paged = self.ceil_page(size)
        self._swa_reserve(paged, 0 if size < left else min(req._maxn, CLIP_MAX_NEW_TOKENS), b["chunk"])
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

    # -- hooks of a second (sliding-window) pool; one pool: no window budget (sglang/swa/scheduler.py)
    def _swa_pass_start(self) -> None:
        pass

    def _swa_left(self) -> float:
        return float("inf")

    def _swa_check_prefill(self, ext: int, max_new: int, chunk_limit: int | None) -> tuple[bool, int | None]:
        return True, chunk_limit

    def _swa_fits_ignore_eos(self, ext: int, max_new: int, chunk_limit: int | None) -> bool:
        return True

    def _swa_reserve(self, paged: int, max_new: int, chunk_limit: int | None) -> None:
        pass

    def _alloc_extend(self, n: int, req: SimRequest) -> None:
        self.pool.alloc(n)

    _simulates_future = True  # add_one_req_ignore_eos's walk (skipped for hybrid SWA, L1292-1304)

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
        if not self._simulates_future:
            return True
        mine = self._req_state(req.ignore_eos, req._maxn, req.output_len, len(req.prompt))
        if self._req_states is None:
            out, maxn, ign, plen = self.run("out", "maxn", "ign", "plen")
            states = [mine] + [self._req_state(bool(g), int(m), int(o), int(p))
                               for g, m, o, p in zip(ign.tolist(), maxn.tolist(), out.tolist(), plen.tolist(),
                                                     strict=True)]
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
