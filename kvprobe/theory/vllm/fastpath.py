"""closed_loop's fast path for vLLM's scheduler: from a *plain* state — every running request
decoding one token per step, holding exactly the blocks of its computed tokens — stretches of
plain decode steps are applied in closed form, and the step that ends one (a pool running dry and
preempting, a finish, an admission) is done by `_plain_step`, which is `step()` specialised to
that state: a few vector operations instead of the general bookkeeping of chunked prefills. The
results are those of `step()`, exactly (tests/theory/test_fastpath.py compares them); no emitted
tokens are produced, so the emulator, which streams them, always calls `step()`.
"""

from __future__ import annotations

import numpy as np

from kvprobe.theory.sim.core import Emitted, SimRequest, StepResult
from kvprobe.theory.sim.pools import Phases


class VllmFastPath:
    """Mixed into VllmScheduler (vllm/scheduler.py), whose state and rules it uses."""

    jump_leaves_events = False  # a jump does the events of a plain state itself (closed_loop asks again)
    _plain = False  # known to be plain (set here once checked; step() and abort clear it)
    # while plain: lower bounds on the steps before a request finishes / reaches its max_tokens
    # and an upper bound on the largest computed length, exact when computed (_cascade), kept as
    # bounds as requests advance, join and leave; step() and abort drop them
    _horizon: list | None = None

    def plain_steps(self, k_max: int) -> int:
        """How many of the next steps are plain decode steps: every running request decodes one
        token within the budget, none finishes, no step runs out of blocks (so none preempts),
        and the head of the queue cannot be admitted. Free blocks only fall and the head's need
        only grows in such a stretch (an eviction can only cut its prefix hits), so a head that
        does not fit at its first step fits at none. `skip(k)` then applies k of them at once."""
        return self._stretch(k_max)[0]

    def _is_plain(self) -> bool:
        L, cfg = self.run, self.cfg
        if not L.n or L.n > cfg.max_num_batched_tokens:  # everyone decodes within the budget
            return False
        if not self._plain:
            comp, ntok, held, ph, fly = L("comp", "ntok", "held", "ph", "fly")
            if self.async_:  # one token in flight, its placeholder counted in comp
                if not ((ph == 1).all() and (fly == 1).all() and (comp == ntok).all()):
                    return False
            elif not (ntok - comp == 1).all():  # the sampled token is the one to compute
                return False
            if not (held == self.fp.blocks(comp)).all():
                return False
            self._plain = True
        return True

    def _stretch(self, k_max: int) -> tuple[int, bool, object]:
        """(plain steps ahead within k_max, whether the state is plain, their phases)."""
        if not self._is_plain():
            return 0, False, None
        L, cfg = self.run, self.cfg
        n = L.n
        comp = L("comp")[0]
        hz = self._horizon
        if hz is None:  # exact; afterwards only preemptions remove requests, so still bounds
            ntok, stop, cap = L("ntok", "stop", "cap")
            hz = self._horizon = [int((stop - ntok).min()), int((cap - comp).min()), int(comp.max())]
        # step k + 1 may finish a request, or reach its max_tokens (async) or max_model_len
        k_other = min(hz[0], hz[1], cfg.max_model_len - hz[2]) - 1
        k = min(k_max, k_other)
        if k <= 0:
            return 0, True, None
        phases = self.fp.phases(comp)
        free = self.pool.num_free
        if self.waiting and n < cfg.max_num_seqs and cfg.max_num_batched_tokens - n > 0:
            if not self.full_isl and cfg.enable_prefix_caching:
                return 0, True, phases  # 0.11's chunk check could start to fit as evictions cut free hits
            if self._head_admission(free - phases.allocs(1), cfg.max_num_batched_tokens - n) is not None:
                return 0, True, phases
        return phases.steps_within(free, k), True, phases

    def skip(self, k: int, phases=None) -> int:
        """Apply k plain decode steps (k <= plain_steps()); returns the sum over those steps of
        the used tokens sampled after each (stats.used_tokens), as k step() calls would see it."""
        L, pool, B = self.run, self.pool, self.B
        comp, ntok, held = L("comp", "ntok", "held")
        phases = phases or self.fp.phases(comp)
        used0 = pool.usable - pool.num_free
        used_sum = k * used0 + phases.allocs_sum(k)
        pool.take(phases.allocs(k))
        comp += k
        ntok += k
        held[:] = self.fp.blocks(comp)
        self._advance_horizon(k)
        self.stats.steps += k
        self.refresh_stats()
        return used_sum * B

    def jump(self, k_max: int) -> tuple[list[tuple[int, int, int, int]], list[SimRequest]]:
        """Up to k_max steps from a plain state: cascades of plain decode stretches and the
        preemptions that end them (`_cascade`), and the other steps that end them
        (`_plain_step`), until a request finishes (its user resubmits), the state stops being
        plain (an admitted prompt needs more chunks) or k_max steps are done. Returns the
        segments [(steps, running, waiting, sum of used tokens after each step)] and the requests
        that finished; nothing if the state is not plain (step() does the next step)."""
        segments, finished = [], []
        while k_max > 0 and not finished and self._is_plain():
            k_max -= self._cascade(k_max, segments, finished)
            if k_max <= 0 or finished or not self._is_plain():
                break
            self._plain_step(finished)
            segments.append((1, self.run.n, len(self.waiting), self.stats.used_tokens))
            k_max -= 1
        return segments, finished

    def _cascade(self, k_max: int, segments: list, finished: list) -> int:
        """Plain decode stretches and the steps in which the pool runs dry (the last requests
        are preempted, nothing else happens), while no request finishes or reaches a limit and
        the head of the queue cannot be admitted; at most k_max steps. Requests advance
        together, so their computed lengths are kept as of the start plus the steps done (`D`),
        written back at the end; their block phases as a histogram of residues mod B. Returns
        the steps done."""
        L, cfg, pool, B = self.run, self.cfg, self.pool, self.B
        n = L.n
        comp = L("comp")[0]
        # step k + 1 may finish a request, or reach its max_tokens (async) or max_model_len
        hz = self._horizon
        limit = k_max if hz is None else min(k_max, hz[0] - 1, hz[1] - 1, cfg.max_model_len - hz[2] - 1)
        if hz is None or limit < k_max:  # no bounds yet, or they bind: the exact values
            ntok, stop, cap = L("ntok", "stop", "cap")
            hz = self._horizon = [int((stop - ntok).min()), int((cap - comp).min()), int(comp.max())]
            limit = min(k_max, hz[0] - 1, hz[1] - 1, cfg.max_model_len - hz[2] - 1)
        if limit <= 0:
            return 0
        res = self._residue(comp)
        hist = np.bincount(res, minlength=B).tolist()
        budget, D = cfg.max_num_batched_tokens, 0
        while D < limit:
            phases = Phases.of_residues(hist, D, n)
            free = pool.num_free
            if self.waiting and n < cfg.max_num_seqs and budget - n > 0:
                if not self.full_isl and cfg.enable_prefix_caching:
                    break  # 0.11's chunk check could start to fit as evictions cut free hits
                if self._head_admission(free - phases.allocs(1), budget - n) is not None:
                    break
            k = phases.steps_within(free, limit - D)
            if k:
                pool.take(phases.allocs(k))
                segments.append((k, n, len(self.waiting), (k * (pool.usable - free) + phases.allocs_sum(k)) * B))
                D += k
            if D == limit:
                break
            n = self._preempting_step(D, res, hist, finished)
            D += 1
            segments.append((1, n, len(self.waiting), (pool.usable - pool.num_free) * B))
            if finished or not n:
                break
        if D:
            comp, ntok, held = L("comp", "ntok", "held")
            comp += D
            ntok += D
            held[:] = self.fp.blocks(comp)
            self._advance_horizon(D)
            self.stats.steps += D
            self.refresh_stats()
        return D

    def _preempting_step(self, D: int, res: np.ndarray, hist: list[int], finished: list) -> int:
        """The step of a cascade in which blocks run out (_allocate's rule on the requests at a
        block boundary): served in running order while blocks last; then the last running
        request is preempted until the one waiting for a block gets it, or is itself the one
        preempted (nothing after it is left). A preempted request's in-flight token arrives.
        Returns the requests left running."""
        L, pool = self.run, self.pool
        result = StepResult(Emitted(), finished, [])
        crossers = (res[: L.n] == (-D) % self.B).nonzero()[0].tolist()
        comp, ntok, held = L("comp", "ntok", "held")
        c, j = len(crossers), 0
        while j < c:
            free = pool.num_free
            if free >= c - j:
                pool.take(c - j)
                break
            pool.take(free)
            j += free
            while True:  # crossers[j] cannot have its block
                v = L.n - 1
                comp[v] += D  # its state as of this step, for _leave
                ntok[v] += D
                held[v] = self.fp.blocks(comp[v])
                hist[res[v]] -= 1
                result.preempted.append(self._preempt_last())
                if v == crossers[c - 1]:
                    c -= 1
                if c <= j:  # it was the one waiting: nothing after it is left
                    break
                if pool.num_free:
                    pool.take(1)
                    j += 1
                    break
        self._deliver_stale(result, emit=False)
        return L.n

    def _residue(self, comp: np.ndarray) -> np.ndarray:
        B = self.B
        return comp & (B - 1) if B & (B - 1) == 0 else comp % B

    def _advance_horizon(self, k: int) -> None:
        hz = self._horizon
        if hz is not None:
            hz[0] -= k
            hz[1] -= k
            hz[2] += k

    def _plain_step(self, finished: list[SimRequest]) -> None:
        """step() from a plain state. _schedule_running: each request needs one token (none if
        async knows it is surely finished, or at max_model_len), a block at a boundary, the
        last ones preempted when blocks run out; _schedule_waiting if nobody was preempted; then
        update_from_output: every request samples (async: the previous step's token arrives and
        one is in flight again), finishes free their blocks after admission, a preempted
        request's in-flight token arrives."""
        L, cfg = self.run, self.cfg
        result = StepResult(Emitted(), finished, [])
        comp, cap = L("comp", "cap")
        need = np.minimum(1, cfg.max_model_len - 1 - comp)
        if self.async_:
            need[comp + 1 >= cap] = 0  # surely finished (L800-814)
        np.maximum(need, 0, out=need)
        preempted = self._allocate(need & (self._residue(comp) == 0), result)
        n = L.n  # requests that ran this step (the preempted ones left from the end)
        comp, ntok, ph, fly, need = *L("comp", "ntok", "ph", "fly"), need[:n]
        comp += need
        stepped = need.astype(bool)
        if self.async_:
            ntok += 1  # the previous step's token (every one of them had one in flight)
            ph[:] = need  # and this step's, if it was scheduled
            fly[:] = need
        else:
            ntok += need
        if not preempted and self.waiting:  # no admission in a step that preempted (L1050)
            self._schedule_waiting(cfg.max_num_batched_tokens - int(need.sum()))
        self._advance_horizon(1)  # still bounds: everyone computed at most one token, sampled one
        if L.n > n:  # admitted: their prefill, sampled if it completed (as _after_schedule)
            comp, ntok, sched, ph, fly = (a[n:] for a in L("comp", "ntok", "sched", "ph", "fly"))
            complete = comp >= ntok
            if self.async_:
                ph[:] = complete
                fly[:] = complete
            else:
                ntok += complete
            sched[:] = 0
            if self._horizon is not None:  # with the new requests' own
                stop, cap = (a[n:] for a in L("stop", "cap"))
                hz = self._horizon
                hz[:] = (min(hz[0], int((stop - ntok).min())), min(hz[1], int((cap - comp).min())),
                         max(hz[2], int(comp.max())))
            sampled = np.concatenate([np.ones(n, bool) if self.async_ else stepped, complete & (not self.async_)])
            self._plain = bool(complete.all())
        else:
            sampled = np.ones(n, bool) if self.async_ else stepped
        self._plain = self._plain and bool(stepped.all())
        ntok, stop = L("ntok", "stop")
        done = (sampled & (ntok >= stop)).nonzero()[0]
        if len(done):
            for i in done.tolist():
                req = L.reqs[i]
                self._leave(req, L.row(i), "finished")
                self._finish(req, result)
            mask = np.ones(L.n, bool)
            mask[done] = False
            L.keep(mask)
            self._plain = self._is_plain_after_finish(done)
        self._deliver_stale(result, emit=False)
        self.stats.steps += 1
        self.refresh_stats()

    def _is_plain_after_finish(self, done) -> bool:
        """Requests left: the rest are as plain as they were (a surely-finished request is gone)."""
        self._plain = False
        return self._is_plain()
