"""SGLang's scheduler (0.5.23, and 0.5.21's new_token_ratio reservation) in virtual time."""

from __future__ import annotations

import numpy as np

from kvprobe.errors import ConfigError
from kvprobe.theory.model.sizes import cdiv
from kvprobe.theory.sglang.fastpath import SglangFastPath
from kvprobe.theory.sglang.radix_cache import SglangTokenPool
from kvprobe.theory.sglang.schedule_policy import CLIP_MAX_NEW_TOKENS, SglangPrefillAdder
from kvprobe.theory.sim.core import (
    Emitted,
    Lanes,
    SchedulerBase,
    SglangConfig,
    SimRequest,
    StepResult,
    output_tokens,
)
from kvprobe.theory.sim.pools import FullAttention

# --------------------------------------------------------------------------- SGLang

RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS (environ.py)


class SglangScheduler(SglangPrefillAdder, SglangFastPath, SchedulerBase):
    """SGLang 0.5.23 scheduler (managers/scheduler.py, schedule_policy.py), and the older releases'
    scheduler-loop rules their config carries (releases.py scheduler_rules).

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
        self._ran = False  # a batch ran in the last step (overlap processes its result in this one)
        # ckpt: tokens of a completed prefill whose batch result (and so its checkpoint into the
        # tree) is still to come; 0 when none is pending
        self.run = Lanes(("plen", "out", "pend", "cur", "held", "maxn", "stop", "ign", "seed", "ckpt"))
        self.chunked: SimRequest | None = None  # request between prefill chunks (not in `run`)
        self.batch_full = False
        # finished requests still in the running batch (releases up to 0.5.22, `finished_leave_at_decode`):
        # each one's reserve left (min(max_new - outputs, clip)) and whether it ignored EOS
        self.lingering: list[tuple[int, bool]] = []
        self._left: np.ndarray | None = None  # running requests this step's decode left out (finishing)
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
        c = self.chunked
        if c is not None and self.radix and c.num_computed_tokens > c._stashed:  # a chunk was computed:
            self._checkpoint(c, c.num_computed_tokens)  # stash_chunked_request (scheduler.py L3913-3920)
            c._stashed = c.num_computed_tokens
        self.run("cur")[0][:] = 0
        self._left = None
        ran = False
        if (self.waiting and not self.batch_full) or self.chunked is not None:
            ran = self._prefill(result)
        if not ran and self.lingering:  # update_running_batch's filter_batch (0.5.19 L3869-3875)
            self.lingering = []
            self.batch_full = False  # the batch shrank (0.5.19 L3943-3944)
        if not ran and self.run.n:
            ran = self._decode(result)
        self._process(result)
        # on_idle (scheduler.py L5241-5330): called when no batch runs (with overlap, none ran in
        # the step before either: its result is processed now); fully idle, it resets the ratio
        if not ran and not (self.cfg.overlap and self._ran) and not self.run.n and not self.waiting \
                and self.chunked is None:
            self.ratio = self.ratio_init
        self._ran = ran
        self.stats.steps += 1
        self.refresh_stats()
        return result

    def _join_running(self, req: SimRequest, held: int) -> None:
        """Prefill done: the request produces its first token with this batch. Its computed
        tokens enter the tree when the batch's result is processed (`_checkpoint` from `_process`:
        batch_result_processor.py L392-394), so a candidate of the same pass, or with overlap of
        the next one, does not match them yet."""
        req.status = "running"
        self.run.append(req, plen=len(req.prompt), out=req.output_len, cur=1, held=held, maxn=req._maxn,
                        stop=req._stop, ign=int(req.ignore_eos), seed=req._seed, ckpt=held if self.radix else 0)

    def _fill(self, req: SimRequest) -> tuple:
        """The request's token ids as SGLang's fill_ids: the prompt, then its outputs so far."""
        n = req.output_len
        if not n:
            return req._tokens
        if len(req._out_ids) < n:  # extended, not rebuilt: a waiting head is matched every step
            more = output_tokens(np.int64(req._seed), np.arange(len(req._out_ids), n))
            req._out_ids += tuple(more.tolist())
        return req._tokens + req._out_ids[:n]

    def _checkpoint(self, req: SimRequest, upto: int) -> None:
        """checkpoint_kv_cache (mem_cache/common.py L271-281): the whole pages of its first `upto`
        tokens are inserted into the tree and locked in place of the prefix it matched; pages a
        twin inserted meanwhile are freed as duplicates."""
        node, already = self.pool.insert(self._fill(req)[:upto], req._node, req._cached)
        self.pool.free(already)
        self.pool.lock(node)
        self.pool.unlock(req._node)
        req._node, req._cached = node, upto // self.ps * self.ps

    # -- decode: update_running_batch (scheduler.py L4459-4552)
    def _decode(self, result: StepResult) -> bool:
        """update_running_batch (scheduler.py L4459-4552). With overlap, a request whose token in
        flight is its last by length (`_reqs_finishing_inflight` L4444-4457: max_new_tokens, not
        an EOS nobody knows yet) is left out of the decode; if nothing else runs, or the rest does
        not fit, the step decodes nothing and the result of the last batch frees it. True if a
        decode batch ran."""
        L = self.run
        out, pend, held, maxn = L("out", "pend", "held", "maxn")
        skip = self.cfg.overlap and not self.cfg.decode_finishing_inflight  # 0.5.22 on (releases.py)
        finishing = (pend > 0) & (out + pend >= maxn) if skip else np.zeros(L.n, bool)
        active = ~finishing
        if finishing.any():  # filtered out of the batch now (L4463-4464): they do not stay once finished
            self._left = finishing
        if not active.any():  # an empty batch: no decode, no ratio decay (L4465-4467)
            self.batch_full = False
            return False
        need = self._decode_need(active, held)
        if need > self._decode_room():
            if finishing.any():  # L4470-4474
                self.batch_full = False
                return False
            self._retract(result)
            self.batch_full = False  # the batch shrank (L4543-4544)
            out, pend, held = L("out", "pend", "held")
            active = np.ones(L.n, bool)
            need = self._decode_need(active, held)
            if need > self._decode_room():
                return True
        else:
            self.ratio = max(self.ratio - self.ratio_decay, self.ratio_min)
        if finishing.any():
            self.batch_full = False  # the batch shrank (L4543-4544)
        self._decode_alloc(active, need)
        held += active
        L("cur")[0][:] = active
        result.decode_seqs = int(active.sum())
        return True

    def _decode_room(self) -> int:
        """What check_decode_mem compares the need with: available + evictable (allocator/base.py
        L171-185, after evicting)."""
        return self.pool.available + self.pool.evictable

    def _decode_alloc(self, active: np.ndarray, need: int) -> None:
        self.pool.alloc(need)

    def _retract_rooms(self) -> list[int]:
        """Room per pool before retracting (one pool here; hybrid SWA has two)."""
        return [self.pool.available + self.pool.evictable]

    def _retract_frees(self, row: dict[str, int], req: SimRequest) -> list[int]:
        """Slots per pool that retracting this request makes available: its private slots, and
        its prompt's tree nodes that become evictable."""
        freed = self._private(row, req)
        if self.radix:
            freed += self.pool.freed_by_unlock(req._node)
        return [freed]

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
        rooms = self._retract_rooms()
        # _get_decode_retraction_order (L3542-3580) sorts by (outputs, -prompt) descending, stably,
        # and pops from the end: among equals the one last in the batch goes first
        order = np.lexsort((-np.arange(L.n), -plen, out)).tolist()
        for i in order[:-1]:
            keep[i] = False
            rooms = [r + f for r, f in zip(rooms, self._retract_frees(L.row(i), L.reqs[i]), strict=True)]
            if self._decode_need(keep, held) <= min(rooms):
                break
        victims = [L.reqs[i] for i in order if not keep[i]]
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
        if self._decode_need(np.ones(L.n, bool), L("held")[0]) > self._decode_room():
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
        out, pend, cur, stop, seed, ckpt = L("out", "pend", "cur", "stop", "seed", "ckpt")
        got = pend.copy() if self.cfg.overlap else cur.copy()
        out += got
        if self.cfg.overlap:
            pend[:] = cur
        for i in ((got > 0) & (ckpt > 0) & (out < stop)).nonzero()[0].tolist():  # prefill results
            self._checkpoint(L.reqs[i], int(ckpt[i]))
            ckpt[i] = 0
        idx = got.nonzero()[0]
        result.emitted = Emitted(L.reqs[idx], seed[idx], out[idx] - 1)
        done = ((got > 0) & (out >= stop)).nonzero()[0]
        if len(done):
            for i in done.tolist():
                req = L.reqs[i]
                self._release(req, L.row(i), finished=True, result=result)
                req.status, req.finish_reason = "finished", self._finish_reason(req)
                del self.requests[req.rid]
                result.finished.append(req)
            if self.cfg.finished_leave_at_decode:  # it stays in the batch until a decode step (<= 0.5.22)
                maxn, ign = L("maxn", "ign")  # unless this step's decode filtered it out already (0.5.22)
                self.lingering += [(min(int(maxn[i] - out[i]), CLIP_MAX_NEW_TOKENS), bool(ign[i]))
                                   for i in done.tolist() if self._left is None or not self._left[i]]
            else:
                self.batch_full = False  # a request left the running batch (L3948-3968)
            mask = np.ones(L.n, bool)
            mask[done] = False
            L.keep(mask)

    def _private(self, row: dict[str, int], req: SimRequest) -> int:
        return self.ceil_page(row["held"]) - req._cached

    def _release(self, req: SimRequest, row: dict[str, int], *, finished: bool, result: StepResult) -> None:
        """Finished: the whole sequence (P + O - 1 tokens) enters the tree unlocked, i.e. evictable
        (common.py release_kv_cache L400-444). Retracted/aborted: private KV is freed, the prompt
        is unlocked (release_req L2360-2395)."""
        pool = self.pool
        # the token in flight of a retracted request is dropped when its batch's result arrives
        # (managers/scheduler_components/batch_result_processor.py L342-350, L1022-1028)
        req.output_len = row["out"]
        req.num_computed_tokens = 0
        if finished and self.radix and row.get("ckpt"):  # finished with its prefill's result
            self._checkpoint(req, row["ckpt"])
        private = self._private(row, req)
        if finished and self.radix:  # its computed pages are in the tree already; the rest is one leaf
            pool.insert_leaf(req._node, ("leaf", req.rid, req.num_preemptions), private)
        else:
            pool.free(private)
        if self.radix:
            pool.unlock(req._node)
        req._node, req._cached, req._stashed = None, 0, 0

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
