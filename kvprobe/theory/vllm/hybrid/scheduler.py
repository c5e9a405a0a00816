"""vLLM 0.33.0's scheduler for hybrid models (sliding-window, chunked-local and Mamba/linear-attention
KV cache groups beside full attention), in virtual time.

The policy is `VllmScheduler`'s (vllm/scheduler.py: FCFS, full-sequence admission, preempt the last
running request, async placeholders); what changes is the KV cache under it. Every allocation goes
through `kv_cache_manager.HybridKVManager`, the engine's per-group KV cache manager with explicit blocks:
a request's blocks in each group are reserved, freed as its window slides, cached sparsely and hit
per group as vLLM does (see kv_cache_manager.py). The loops here are the engine's own
(v1/core/sched/scheduler.py): the RUNNING loop L794-1034 allocates request by request, freeing
what left the window first, and preempts the last running request when a request's blocks do not
fit; the WAITING loop L1049-1600 looks up the reconciled prefix hit, checks the full sequence
with the window groups' admission cap and admits; with Mamba groups in "align" mode every prefill
chunk ends on a block boundary (`_mamba_block_aligned_split` L546-662).

The fast path does not jump over hybrid stretches: `jump` finds none and `closed_loop` steps (the
same results, exactly; tests/theory/test_fastpath.py includes hybrid shapes).
"""

from __future__ import annotations

import numpy as np

from kvprobe.errors import ConfigError
from kvprobe.theory.sim.core import Lanes, SimRequest, StepResult, VllmConfig
from kvprobe.theory.sim.pools import prompt_keys
from kvprobe.theory.vllm.hybrid.block_pool import checkpoint_position, checkpoint_valid
from kvprobe.theory.vllm.hybrid.kv_cache_manager import FULL, MAMBA, HybridKVManager, KVGroup, KVRequest
from kvprobe.theory.vllm.scheduler import VllmScheduler

# infl: tokens in flight (num_in_flight_tokens); qs, qc, qp: HybridKVManager.quiet of the request
_COLUMNS = ("comp", "ntok", "held", "stop", "plen", "sched", "seed", "cap", "ph", "fly", "infl", "qs", "qc", "qp")


def kv_groups(config: VllmConfig) -> tuple[KVGroup, ...]:
    """The config's groups as KVGroup objects (closed_loop's cache passes them back as tuples)."""
    return tuple(g if isinstance(g, KVGroup) else KVGroup(*g) for g in config.groups)


def in_flight_tokens(config: VllmConfig) -> int:
    """VllmConfig.max_in_flight_tokens (config/vllm.py L586-608), pipeline parallelism 1; before the
    release that has it (`window_in_flight` off) one batch, max_num_batched_tokens."""
    async_ = config.async_scheduling and config.window_in_flight
    return (2 if async_ else 1) * config.max_num_batched_tokens


class HybridVllmScheduler(VllmScheduler):
    memo = False  # the head's hits change as windows free blocks: always re-check it

    def __init__(self, config: VllmConfig):
        super().__init__(config)
        groups = kv_groups(config)
        if not groups:
            raise ConfigError("a hybrid scheduler needs the model's KV cache groups", key="groups")
        mamba = [g for g in groups if g.kind == MAMBA]
        if mamba and config.enable_prefix_caching and any(g.block_size not in (0, config.block_size) for g in mamba):
            raise ConfigError("Mamba groups with prefix caching share the attention block size "
                              "(mamba_cache_mode align)", key="groups")
        self.groups = groups
        # retention None: dense, every full block of a window / Mamba group cached (0.18.1
        # single_type_kv_cache_manager.py L250-274 cache_blocks, no mask; 0.28.0's default too); 0: 0.33.0's
        # sparse retention (single_type_kv_cache_manager.py L477-543 reachable_block_mask). Dense, a preempted
        # request's window blocks stay hittable: its hit reaches the prompt's computed blocks and its
        # admission charges them with the rest of the prompt at once (allocate_slots, kv_cache_manager.py
        # L334-350 in 0.18.1), so it may wait where a fresh first chunk would be admitted.
        retention = 0 if config.sparse_retention else None
        self.kvm = HybridKVManager(groups, config.num_gpu_blocks, block_size=config.block_size,
                                   caching=config.enable_prefix_caching, max_model_len=config.max_model_len,
                                   in_flight=in_flight_tokens(config), watermark_blocks=self.watermark,
                                   retention=retention, admission_cap=config.window_admission_cap,
                                   free_processed=config.window_in_flight,
                                   free_order=config.free_order)
        # "align" mode: prefill chunks end on block boundaries (scheduler.py L430-434); with prefill
        # checkpoint blocks in every Mamba group, the first group's alignment (L435-449)
        self.align_split = bool(mamba) and config.enable_prefix_caching
        self.checkpoint = mamba[0].checkpoint if mamba and all(g.checkpoint for g in mamba) else 0
        self.run = Lanes(_COLUMNS)
        self.refresh_stats()

    def add(self, req: SimRequest) -> None:
        super().add(req)
        keys = req._pkeys if self.cfg.enable_prefix_caching else []
        req._kv = KVRequest(req.rid, len(req.prompt), keys or prompt_keys(req.prompt, self.B))

    def jump(self, k_max: int):
        return [], []  # no closed-form stretches for hybrid pools: closed_loop steps

    # -- one engine step
    def _after_schedule(self, result: StepResult) -> None:
        sched, infl = self.run("sched", "infl")
        infl[:] = sched if self.async_ else 0  # num_in_flight_tokens at the next schedule()
        super()._after_schedule(result)

    def _update_from_output(self, result: StepResult, sampled: np.ndarray) -> None:
        """Async: a running request's output hashes its blocks up to its processed tokens before
        it may finish and free them (update_from_output L2396-2416: cache_blocks(num_computed -
        num_in_flight) for a request with placeholders), so a finished request's last full block
        leaves hashed."""
        L = self.run
        if self.async_ and self.cfg.enable_prefix_caching and L.n:
            comp, ntok, infl, qc = L("comp", "ntok", "infl", "qc")
            n = comp - infl
            for i in (sampled & (np.minimum(n, ntok + 1) >= qc)).nonzero()[0].tolist():
                kv = self._kv(i)
                kv.num_tokens += 1  # the token this output appends
                self.kvm.cache_blocks(kv, int(n[i]))
                self._set_quiet(i, kv.rid)
        super()._update_from_output(result, sampled)

    def _kv(self, i: int, waiting: bool = False) -> KVRequest:
        """The lane's request as the KV cache manager reads it."""
        comp, ntok, infl = self.run("comp", "ntok", "infl")
        kv = self.run.reqs[i]._kv
        kv.num_computed_tokens, kv.num_tokens, kv.num_in_flight_tokens = int(comp[i]), int(ntok[i]), int(infl[i])
        kv.waiting = waiting
        return kv

    def _schedule_running(self, budget: int, result: StepResult) -> int:
        """The RUNNING loop (L794-1034): each request's tokens within the budget and max_model_len
        (none for one surely finished, L800-814), the Mamba split, then allocate_slots; when that
        fails, preempt the last running request and retry; the request preempting itself ends the
        loop. When the budget covers everyone, a request whose allocate_slots would do nothing
        (`quiet`) is scheduled without the call, as a vector."""
        L, cfg = self.run, self.cfg
        if not L.n:
            return budget
        comp, ntok, ph, cap, infl, qs, qc, qp = L("comp", "ntok", "ph", "cap", "infl", "qs", "qc", "qp")
        need = np.minimum(ntok + ph - comp, cfg.max_model_len - 1 - comp)
        if self.async_:
            need[(ph > 0) & (comp + 2 - ph >= cap)] = 0
        np.maximum(need, 0, out=need)
        if need.sum() > budget:  # FCFS within the budget: request by request
            return self._schedule_each(budget, result)
        slots = comp + need
        # the tokens remove_skipped frees on: processed (comp - infl), or before 0.26.0 the computed ones
        # (allocate_slots, kv_cache_manager.py L334-336 in 0.18.1: remove_skipped_blocks(total_computed_tokens))
        processed = comp - infl if self.kvm.free_processed else comp
        quiet = (need == 0) | ((slots <= qs) & (np.minimum(slots, ntok) < qc) & (processed < qp))
        for i in (~quiet).nonzero()[0].tolist():
            if i >= L.n:
                break
            n = int(need[i])
            kv = self._kv(i)
            if self.align_split:
                n = need[i] = self._aligned_split(kv, n, kv.num_computed_tokens)
                if n <= 0:
                    continue
            if not self._allocate(i, kv, n, result):
                break
        n = L.n
        comp, sched = L("comp", "sched")
        sched[:] = need[:n]
        comp += sched
        return budget - int(sched.sum())

    def _schedule_each(self, budget: int, result: StepResult) -> int:
        L, cfg = self.run, self.cfg
        i = 0
        while i < L.n and budget > 0:
            comp, ntok, ph, cap, sched = L("comp", "ntok", "ph", "cap", "sched")
            c, p = int(comp[i]), int(ph[i])
            if self.async_ and p > 0 and c + 2 - p >= cap[i]:
                i += 1
                continue
            need = min(int(ntok[i]) + p - c, budget, cfg.max_model_len - 1 - c)
            kv = self._kv(i)
            if self.align_split and need > 0:
                need = self._aligned_split(kv, need, c)
            if need <= 0:
                i += 1
                continue
            if not self._allocate(i, kv, need, result):
                break
            sched[i] = need
            budget -= need
            i += 1
        comp, sched = L("comp", "sched")
        comp += sched
        return budget

    def _allocate(self, i: int, kv: KVRequest, need: int, result: StepResult) -> bool:
        """allocate_slots for running request i, preempting the last ones until it fits (L912-994).
        False if request i preempted itself."""
        L = self.run
        while not self.kvm.allocate_slots(kv, need):
            victim = L.n - 1
            result.preempted.append(self._preempt_last())
            if victim == i:
                return False
        self._set_quiet(i, kv.rid)
        return True

    def _set_quiet(self, i: int, rid: str) -> None:
        qs, qc, qp = self.run("qs", "qc", "qp")
        qs[i], qc[i], qp[i] = self.kvm.quiet(rid)

    def _schedule_waiting(self, budget: int) -> None:
        """The WAITING loop (L1049-1600): FCFS, the reconciled hit, full-sequence admission."""
        cfg, L = self.cfg, self.run
        while self.waiting and budget > 0 and L.n < cfg.max_num_seqs:
            req = self.waiting[0]
            kv = req._kv
            num_tokens = len(req.prompt) + req.output_len
            kv.num_tokens, kv.num_computed_tokens, kv.num_in_flight_tokens, kv.waiting = num_tokens, 0, 0, True
            hits, h, kv.shared_prefix_boundary = self.kvm.find_hit(kv)
            new = num_tokens - h
            if not cfg.enable_chunked_prefill and new > budget:
                break
            new = min(new, budget)
            if self.align_split:
                new = self._aligned_split(kv, new, h)
                if new == 0:
                    break
            if not self.kvm.allocate_slots(kv, new, hits, h, full_must_fit=self.full_isl, has_scheduled=bool(L.n)):
                break
            self.waiting.popleft()
            if cfg.enable_prefix_caching:
                self.stats.prefix_queries_total += num_tokens
                self.stats.prefix_hits_total += h
            req.status = "running"
            P = len(req.prompt)
            L.append(req, comp=h + new, ntok=num_tokens, stop=req._stop, plen=P, sched=new, seed=req._seed,
                     cap=P + req.max_tokens)
            self._set_quiet(L.n - 1, req.rid)
            budget -= new

    def _aligned_split(self, kv: KVRequest, num_new: int, start: int) -> int:
        """`_mamba_block_aligned_split` (scheduler.py L546-662) without partial hash hits or EAGLE:
        a prefill chunk stops at a block boundary, at the last cacheable boundary of the sequence,
        and at the shared-prefix junction — unless it reaches the prefill's end and the backend
        exports that boundary's state from inside it (prefill checkpoint blocks, L587-606)."""
        prefill_end = max(kv.num_prompt_tokens, kv.num_tokens - 1)
        if start >= prefill_end:
            return num_new
        B = self.B
        last_cache = checkpoint_position(kv.num_tokens, B)
        end = start + num_new
        internal = end >= prefill_end and checkpoint_valid(start, end, checkpoint_position(prefill_end, B), B,
                                                           self.checkpoint)
        if internal:
            last_cache = 0
        if end < prefill_end:
            aligned = end // B * B
            if aligned > start or B <= self.cfg.max_num_batched_tokens:
                end = aligned
        junction = kv.shared_prefix_boundary
        stops = ((start // B + 1) * B if start % B and not internal else 0, last_cache,
                 start + (junction - start) // B * B if start < junction < end else 0)
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    # -- leaving
    def _leave(self, req: SimRequest, row: dict[str, int], status: str) -> None:
        req.output_len = row["ntok"] - row["plen"]
        req.num_computed_tokens = row["comp"]
        req.status = status
        self.kvm.free(req._kv)

    # -- observation
    def check_pool(self) -> None:
        self.kvm.check([self.run.reqs[i].rid for i in range(self.run.n)])

    def refresh_stats(self) -> None:
        kvm = getattr(self, "kvm", None)
        if kvm is None:  # VllmScheduler.__init__ runs before the pool exists
            return super().refresh_stats()
        s, pool, B = self.stats, kvm.pool, self.B
        usable = pool.num_gpu_blocks - 1
        s.running, s.waiting = self.run.n, len(self.waiting)
        s.waiting_capacity = s.waiting
        s.usage = pool.usage  # all groups' blocks over the one pool (block_pool.py L921-932)
        s.used_tokens = (usable - pool.num_free) * B
        s.pool_tokens = usable * B


def is_hybrid(config: VllmConfig) -> bool:
    groups = kv_groups(config)
    return bool(groups) and not (len(groups) == 1 and groups[0].kind == FULL and groups[0].copies == 1)
