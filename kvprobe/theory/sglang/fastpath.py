"""closed_loop's fast path for SGLang's scheduler: stretches of plain decode steps (no prefill
attempted, everyone decoding, nothing finishing or running out of slots) applied at once; mixed
into SglangScheduler (sglang/scheduler.py). The results are those of step(), exactly
(tests/theory/test_fastpath.py)."""

from __future__ import annotations

from kvprobe.theory.sim.core import SimRequest


class SglangFastPath:
    """k plain decode steps in one jump."""

    jump_leaves_events = True  # the step after a jump cut short is an event for step()

    def plain_steps(self, k_max: int) -> int:
        """How many of the next steps are plain decode steps: no prefill is attempted (nothing
        waits, or admission is latched by batch_full), every running request decodes (its token
        known, none finishing in flight), none finishes, and no step runs out of slots. In such
        a stretch only counters move, so `skip(k)` can apply k of them at once."""
        L, pool = self.run, self.pool
        if not L.n or self.chunked is not None or (self.waiting and not self.batch_full) or self.lingering:
            return 0
        out, pend, stop, held, ckpt = L("out", "pend", "stop", "held", "ckpt")
        if (self.cfg.overlap and not (pend == 1).all()) or ckpt.any():  # a prefill's result to come
            return 0
        k = min(k_max, int((stop - out).min()) - 1)
        if k <= 0:
            return 0
        return self.fp.steps_within(held, (pool.available + pool.evictable) // self.ps, k)

    def jump(self, k_max: int) -> tuple[list[tuple[int, int, int, int]], list[SimRequest]]:
        """closed_loop's fast path (see VllmScheduler.jump): one plain decode stretch."""
        k = self.plain_steps(k_max)
        if not k:
            return [], []
        used = self.skip(k)
        return [(k, self.run.n, len(self.waiting), used)], []

    def skip(self, k: int) -> int:
        """Apply k plain decode steps (k <= plain_steps()); returns the sum over those steps of
        the used-token count sampled after each, as k calls of step() would have seen it."""
        L, pool, ps = self.run, self.pool, self.ps
        held, out = L("held", "out")
        used0 = pool.used
        phases = self.fp.phases(held)
        used_sum = k * used0 + ps * phases.allocs_sum(k)
        pool.alloc(ps * phases.allocs(k))
        for _ in range(k):  # the same float operations as k decode steps
            if self.ratio == self.ratio_min:
                break
            self.ratio = max(self.ratio - self.ratio_decay, self.ratio_min)
        self._ran = True
        held += k
        out += k
        L("cur")[0][:] = 1
        self.stats.steps += k
        self.refresh_stats()
        return used_sum
