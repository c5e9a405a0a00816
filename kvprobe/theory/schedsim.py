"""Virtual-time, step-by-step schedulers of vLLM 0.33 and SGLang 0.5.23 (and their older policies).

One `step()` is one engine iteration. The emulator runs the same objects in real time: it calls
`add` for a new request, `abort` when a client disconnects, `step` in its loop, streams
`StepResult.emitted` and exports `stats`. Rules and citations come from
shared/reference/vllm.md §2-3 and shared/reference/sglang.md §2-3 (file:line of the engines).

Speed: running requests live in numpy columns (`_Lanes`), so a decode step over 1,000 requests is
a handful of vector operations; Python code runs only on events (admission, finish, preemption,
retraction, a prefill chunk, prefix-cache hashing).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import astuple, dataclass, field
from functools import lru_cache

import numpy as np

from kvprobe.errors import ConfigError
from kvprobe.theory.pools import VOCAB, SglangTokenPool, VllmBlockPool, prompt_keys, rid_seed


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- public data


@dataclass
class VllmConfig:
    num_gpu_blocks: int  # as vLLM logs it: includes the null block
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    policy: str = "vllm-0.33"  # "vllm-0.33" (full-prompt admission) | "vllm-0.11" (first-chunk admission)
    watermark: float = 0.0


@dataclass
class SglangConfig:
    max_total_num_tokens: int
    page_size: int = 1
    max_running_requests: int = 2048
    chunked_prefill_size: int = 8192  # <= 0: disabled
    max_prefill_tokens: int = 16384
    context_len: int = 8192
    disable_radix_cache: bool = False
    policy: str = "sglang-0.5.22"  # "sglang-0.5.22" (ignore_eos reserved at 1.0) | "sglang-0.5.21" (new_token_ratio)
    schedule_conservativeness: float = 1.0
    overlap: bool = True


@dataclass(eq=False)
class SimRequest:
    rid: str
    prompt: Sequence[int]  # token ids; prefix caching hashes full blocks of them
    max_tokens: int
    ignore_eos: bool = True
    eos_after: int | None = None  # finish after this many output tokens (pseudo-EOS) unless ignore_eos
    # scheduler-owned state; refreshed when the request leaves the running set (see Scheduler.sync)
    status: str = field(default="new", init=False)  # waiting|running|preempted|finished|aborted
    finish_reason: str | None = field(default=None, init=False)  # "length" | "stop" | "abort"
    output_len: int = field(default=0, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_preemptions: int = field(default=0, init=False)  # vLLM preemptions / SGLang retractions
    _seed: int = field(default=0, init=False, repr=False)
    _pkeys: list = field(default_factory=list, init=False, repr=False)  # chained hashes of prompt units
    _keys: list = field(default_factory=list, init=False, repr=False)  # cached units it holds / locks
    _stop: int = field(default=0, init=False, repr=False)
    _maxn: int = field(default=0, init=False, repr=False)  # SGLang max_new_tokens after clipping


class Emitted(Sequence):
    """`StepResult.emitted`: a list-like of (request, token id), built only when read."""

    def __init__(self, reqs: np.ndarray | None = None, tokens: np.ndarray | None = None):
        self._reqs = reqs if reqs is not None else np.empty(0, dtype=object)
        self._tokens = tokens if tokens is not None else np.empty(0, dtype=np.int64)
        self._extra: list[tuple[SimRequest, int]] = []

    def __len__(self) -> int:
        return len(self._reqs) + len(self._extra)

    def __getitem__(self, i):
        return list(self)[i]

    def __iter__(self):
        yield from zip(self._reqs.tolist(), self._tokens.tolist(), strict=True)
        yield from self._extra


@dataclass
class StepResult:
    emitted: Emitted  # (request, new output token id) for every request that produced a token
    finished: list[SimRequest]  # finished this step (their blocks already freed)
    preempted: list[SimRequest]  # preempted (vLLM) / retracted (SGLang) this step
    prefill_tokens: int = 0  # prompt tokens computed this step (time model)
    decode_seqs: int = 0  # sequences decoded this step (time model)


@dataclass
class SchedulerStats:
    running: int = 0
    waiting: int = 0
    waiting_capacity: int = 0
    usage: float = 0.0  # the engine's own gauge: vllm:kv_cache_usage_perc / sglang:token_usage
    used_tokens: int = 0
    pool_tokens: int = 0
    preemptions_total: int = 0  # vLLM preemptions; SGLang retractions (same counter role)
    prefix_queries_total: int = 0
    prefix_hits_total: int = 0
    new_token_ratio: float | None = None
    retracted_total: int = 0
    steps: int = 0


def output_tokens(seeds: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Output token id number `index` (0-based) of each request: a function of rid and position
    only, so simulation and emulation produce (and cache) the same tokens."""
    return (seeds + index * 40503 + 17) % VOCAB


class _Lanes:
    """The running requests as int64 numpy columns (struct of arrays) in running order."""

    def __init__(self, columns: Sequence[str]):
        self.n, self.cap = 0, 64
        self.cols = {c: np.zeros(self.cap, np.int64) for c in columns}
        self.reqs = np.empty(self.cap, dtype=object)

    def __call__(self, *names: str) -> list[np.ndarray]:
        """Views of the live part of the named columns (write through)."""
        return [self.cols[c][: self.n] for c in names]

    def append(self, req: SimRequest, **values: int) -> None:
        if self.n == self.cap:
            self.cap *= 2
            self.cols = {c: np.resize(a, self.cap) for c, a in self.cols.items()}
            self.reqs = np.resize(self.reqs, self.cap)
        for c, a in self.cols.items():
            a[self.n] = values.get(c, 0)
        self.reqs[self.n] = req
        self.n += 1

    def row(self, i: int) -> dict[str, int]:
        return {c: int(a[i]) for c, a in self.cols.items()}

    def keep(self, mask: np.ndarray) -> None:
        idx = np.flatnonzero(mask)
        for a in self.cols.values():
            a[: len(idx)] = a[: self.n][idx]
        self.reqs[: len(idx)] = self.reqs[: self.n][idx]
        self.reqs[len(idx) : self.n] = None
        self.n = len(idx)

    def index(self, req: SimRequest) -> int:
        for i in range(self.n):
            if self.reqs[i] is req:
                return i
        raise KeyError(req.rid)


class _Base:
    """What both schedulers share: request bookkeeping, abort, stats plumbing."""

    stats: SchedulerStats

    def __init__(self):
        self.waiting: deque[SimRequest] = deque()
        self.requests: dict[str, SimRequest] = {}
        self.stats = SchedulerStats()

    def _accept(self, req: SimRequest, stop_tokens: int) -> None:
        if req.rid in self.requests:
            raise ValueError(f"duplicate request id {req.rid!r}")
        if not req.prompt:
            raise ValueError(f"request {req.rid!r}: empty prompt")
        req._seed = rid_seed(req.rid)
        req._stop = stop_tokens
        req.status = "waiting"
        self.requests[req.rid] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.run.n or self.waiting)

    def abort(self, rid: str) -> None:
        """Client disconnect: remove the request wherever it is and free everything it holds."""
        req = self.requests.pop(rid, None)
        if req is None:
            return
        if req.status in ("waiting", "preempted"):
            self.waiting.remove(req)
        else:
            self._abort_running(req)
        req.status, req.finish_reason = "aborted", "abort"
        self._refresh_stats()

    def _finish_reason(self, req: SimRequest) -> str:
        eos = not req.ignore_eos and req.eos_after is not None and req.output_len >= req.eos_after
        return "stop" if eos else "length"


# --------------------------------------------------------------------------- vLLM


class VllmScheduler(_Base):
    """vLLM V1 `Scheduler.schedule()` + `update_from_output()` (v1/core/sched/scheduler.py, 0.33.0).

    Synchronous scheduling: the server's default async scheduling (batch queue of 2, vllm.md §2.6)
    is not modelled. It allocates the same slots one step earlier and frees finished requests one
    iteration later, so measured usage can sit a little above this model near saturation.
    """

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
        self.run = _Lanes(("comp", "ntok", "held", "stop", "plen", "sched", "seed"))
        self.full_isl = config.policy == "vllm-0.33"  # --scheduler-reserve-full-isl, absent in 0.11
        self.watermark = int(config.watermark * config.num_gpu_blocks) if self.full_isl else 0
        self._refresh_stats()

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
        self._refresh_stats()

    # -- one engine step
    def step(self) -> StepResult:
        result = StepResult(Emitted(), [], [])
        budget = self.cfg.max_num_batched_tokens
        budget = self._schedule_running(budget, result)
        if not result.preempted:  # no admission in a step that preempted (L1050)
            self._schedule_waiting(budget)
        self._update_from_output(result)
        self.stats.steps += 1
        self._refresh_stats()
        return result

    def _schedule_running(self, budget: int, result: StepResult) -> int:
        """RUNNING loop (L794-1034): decode 1 token / chunked-prefill the rest within the budget;
        on allocation failure preempt the LAST running request and retry (L930-994)."""
        L, pool, B = self.run, self.pool, self.B
        if not L.n:
            return budget
        comp, ntok, held, sched, plen = L("comp", "ntok", "held", "sched", "plen")
        need = ntok - comp
        np.clip(budget - (np.cumsum(need) - need), 0, need, out=sched)
        new_blocks = np.maximum(-(-(comp + sched) // B) - held, 0)
        cum = np.cumsum(new_blocks)
        if cum[-1] <= pool.num_free:  # everyone fits: the common case, fully vectorised
            pool.take(int(cum[-1]))
            held += new_blocks
        else:
            k = int(np.searchsorted(cum, pool.num_free, side="right"))  # first request that fails
            pool.take(int(cum[k - 1]) if k else 0)
            held[:k] += new_blocks[:k]
            while k < L.n:
                while new_blocks[k] > pool.num_free:
                    victim = L.n - 1
                    result.preempted.append(self._preempt_last())
                    if victim == k:
                        break
                else:
                    pool.take(int(new_blocks[k]))
                    held[k] += new_blocks[k]
                    k += 1
                    continue
                break  # the request preempted itself: nothing after it is left
            comp, sched, plen = L("comp", "sched", "plen")
        prefilling = np.flatnonzero((comp < plen) & (sched > 0))
        comp += sched
        for i in prefilling.tolist():
            self._cache_prompt_blocks(L.reqs[i], int(comp[i]))
        return budget - int(sched.sum())

    def _schedule_waiting(self, budget: int) -> None:
        """WAITING loop (L1049-1600): FCFS, head-of-line blocking, full-sequence-must-fit (0.33)."""
        cfg, L, pool, B = self.cfg, self.run, self.pool, self.B
        while self.waiting and budget > 0:
            if L.n >= cfg.max_num_seqs:
                break
            req = self.waiting[0]
            P, num_tokens = len(req.prompt), len(req.prompt) + req.output_len
            hits = self._lookup(req, num_tokens) if cfg.enable_prefix_caching else []
            h, hit_free = len(hits), sum(1 for key in hits if key in pool.lru)
            new = num_tokens - h * B
            if not cfg.enable_chunked_prefill and new > budget:
                break
            new = min(new, budget)
            # allocate_slots (kv_cache_manager.py L518-588): watermark only when something runs;
            # evictable hits still consume free-queue entries (single_type_kv_cache_manager L238-265)
            wm, free = (self.watermark if L.n else 0), pool.num_free
            if self.full_isl and cdiv(min(num_tokens, cfg.max_model_len), B) - h + hit_free + wm > free:
                break
            fresh = cdiv(h * B + new, B) - h
            if fresh + hit_free + wm > free:
                break
            self.waiting.popleft()
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
                     sched=new, seed=req._seed)
            budget -= new

    def _update_from_output(self, result: StepResult) -> None:
        """update_from_output (L2259-2676): sample one token for every request whose whole sequence
        is computed; finish on max_tokens / max_model_len / eos; free blocks in the same call."""
        L = self.run
        if not L.n:
            return
        comp, ntok, sched, stop, plen, seed = L("comp", "ntok", "sched", "stop", "plen", "seed")
        decoding = (sched > 0) & (comp - sched >= plen)
        result.decode_seqs = int(decoding.sum())
        result.prefill_tokens = int(sched.sum()) - result.decode_seqs
        sampled = (sched > 0) & (comp == ntok)
        idx = np.flatnonzero(sampled)
        ntok[idx] += 1
        result.emitted = Emitted(L.reqs[idx], output_tokens(seed[idx], ntok[idx] - plen[idx] - 1))
        done = np.flatnonzero(sampled & (ntok >= stop))
        if len(done):
            for i in done.tolist():
                req = L.reqs[i]
                self._leave(req, L.row(i), "finished")
                req.finish_reason = self._finish_reason(req)
                del self.requests[req.rid]
                result.finished.append(req)
            mask = np.ones(L.n, bool)
            mask[done] = False
            L.keep(mask)
        sched[:] = 0

    # -- events
    def _preempt_last(self) -> SimRequest:
        """_preempt_request (L1799-1843): free all blocks, num_computed = 0, front of waiting."""
        L = self.run
        req = L.reqs[L.n - 1]
        self._leave(req, L.row(L.n - 1), "preempted")
        L.keep(np.arange(L.n) < L.n - 1)
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
        keys, full, dead = req._keys, row["comp"] // self.B, 0
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
        hits = []
        for k in range((num_tokens - 1) // self.B):
            key = self._block_key(req, k)
            if not self.pool.is_cached(key):
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

    def _refresh_stats(self) -> None:
        s, pool, B = self.stats, self.pool, self.B
        s.running, s.waiting = self.run.n, len(self.waiting)
        s.waiting_capacity = s.waiting
        s.usage = pool.usage
        s.used_tokens = (pool.usable - pool.num_free) * B
        s.pool_tokens = pool.usable * B


# --------------------------------------------------------------------------- SGLang

CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION (schedule_policy.py L89-91)
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS (environ.py)


class SglangScheduler(_Base):
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
        self.unit = 0 if config.disable_radix_cache else (self.ps if self.ps > 1 else 16)
        self.pool = SglangTokenPool(config.max_total_num_tokens, self.unit or self.ps)
        self.run = _Lanes(("plen", "out", "pend", "cur", "held", "maxn", "stop", "ign", "seed"))
        self.chunked: SimRequest | None = None  # request between prefill chunks (not in `run`)
        self.batch_full = False
        # NewTokenRatioTracker (new_token_ratio_tracker.py L13-49; env defaults environ.py L646-650)
        self.ratio_init = min(0.7 * config.schedule_conservativeness, 1.0)
        self.ratio_min = min(self.ratio_init * 0.14, 1.0)
        self.ratio_decay = (self.ratio_init - self.ratio_min) / 600
        self.ratio = self.ratio_init
        self._refresh_stats()

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
        if self.unit:
            req._pkeys = prompt_keys(req.prompt, self.unit)
        self._accept(req, stop)
        self._refresh_stats()

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
        self._refresh_stats()
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
        free = pool.available + pool.evictable
        b = {"total": float(reserve.sum()), "current": 0, "input": cfg.max_prefill_tokens,
             "chunk": cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else None}
        scheduled = 0
        if self.chunked is not None:
            scheduled += self._continue_chunk(free, b, result)
        admitted: list[SimRequest] = []
        room = cfg.max_running_requests - L.n  # get_num_allocatable_reqs (scheduler.py L4027-4050)
        if room <= 0 and self.waiting:
            self.batch_full = True
        while self.waiting and not self.batch_full and self.chunked is None:
            if len(admitted) >= room:
                self.batch_full = True
                break
            req = self.waiting[0]
            P, done = len(req.prompt), req.output_len
            hits = pool.match(req._pkeys[: (P + done - 1) // self.unit]) if self.unit else []
            prefix = len(hits) * (self.unit or 1)
            ext = P + done - prefix
            max_new = min(max(req._maxn - done, 0), CLIP_MAX_NEW_TOKENS)
            rem_total = free - pool.evictable_in(hits) - b["total"]  # matched prefix locked
            if not self.unit and req.ignore_eos:
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
            pool.lock(hits)
            req._keys = hits
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
        """add_one_req_ignore_eos (L1241-1383), the --disable-radix-cache path: simulate the
        future finishing order of everyone and refuse if some point runs out of room."""
        ps = self.ps
        paged_input = self.ceil_page(ext) + ps
        if paged_input > min(rem_current, rem_total):
            return False
        out, maxn, ign, plen = self.run("out", "maxn", "ign", "plen")
        ratio = np.where(ign > 0, 1.0, self.ratio)
        left = np.concatenate(([req._maxn - req.output_len], maxn * ratio - out))
        occ = np.concatenate(([len(req.prompt) + req.output_len], plen + out))
        keep = left > 0
        order = np.argsort(left[keep], kind="stable")
        left, occ = left[keep][order], occ[keep][order]
        bs = len(left) - np.arange(len(left))
        freed = np.cumsum(occ) - occ
        cur = rem_current - paged_input
        return not bool(np.any(cur + freed - left * bs <= bs))  # IGNORE_EOS_RESERVE_TOKENS = 1

    def _join_running(self, req: SimRequest, held: int) -> None:
        """Prefill done: the prompt is checkpointed into the tree and locked (common.py L271-281);
        the request produces its first token with this batch."""
        if self.unit:
            for key in req._pkeys[len(req._keys) : len(req.prompt) // self.unit]:
                if not self.pool.insert(key, self.unit, locked=True):
                    self.pool.lock([key])  # a twin prefilled it meanwhile: share, drop our copy
                    self.pool.free(self.unit)
                req._keys.append(key)
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
            room += sum(pool.units[k][0] for k in req._keys if pool.units[k][1] == 1)
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
        result.emitted = Emitted(L.reqs[idx], output_tokens(seed[idx], out[idx] - 1))
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
        return self.ceil_page(row["held"]) - len(req._keys) * (self.unit or 0)

    def _release(self, req: SimRequest, row: dict[str, int], *, finished: bool, result: StepResult) -> None:
        """Finished: the whole sequence (P + O - 1 tokens) enters the tree unlocked, i.e. evictable
        (common.py release_kv_cache L400-444). Retracted/aborted: private KV is freed, the prompt
        is unlocked (release_req L2360-2395)."""
        pool, unit = self.pool, self.unit
        req.output_len = row["out"]
        if not finished and row["pend"]:  # an in-flight token of a retracted request is kept
            req.output_len += row["pend"]
            result.emitted._extra.append((req, int(output_tokens(np.int64(row["seed"]), req.output_len - 1))))
        req.num_computed_tokens = 0
        private = self._private(row, req)
        if finished and unit:  # prompt units are in the tree already; the rest is one leaf
            pool.insert(("leaf", req.rid, req.num_preemptions), private, locked=False)
        else:
            pool.free(private)
        pool.unlock(req._keys)
        req._keys = []

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
            private += self.ceil_page(c.num_computed_tokens) - len(c._keys) * (self.unit or 0)
        self.pool.check(private)

    def _refresh_stats(self) -> None:
        s, pool = self.stats, self.pool
        s.running, s.waiting = self.run.n, len(self.waiting)
        s.waiting_capacity = s.waiting
        s.usage = pool.token_usage
        s.used_tokens = pool.used
        s.pool_tokens = pool.size
        s.new_token_ratio = self.ratio
        s.preemptions_total = s.retracted_total


def make_scheduler(config: VllmConfig | SglangConfig) -> VllmScheduler | SglangScheduler:
    if isinstance(config, VllmConfig):
        return VllmScheduler(config)
    if isinstance(config, SglangConfig):
        return SglangScheduler(config)
    raise ConfigError(f"expected VllmConfig or SglangConfig, got {type(config).__name__}")


# --------------------------------------------------------------------------- closed loop


@dataclass(frozen=True)
class ClosedLoopStats:
    running_mean: float
    running_max: int
    waiting_mean: float
    waiting_max: int
    usage_mean: float
    usage_at_full: float  # mean usage gauge over steps with someone waiting (max usage if none)
    preemptions_per_1k_steps: float  # vLLM preemptions / SGLang retractions
    steps: int  # length of the measured window


def closed_loop(config: VllmConfig | SglangConfig, prompt_tokens: int, output_tokens: int, users: int, *,
                steps: int = 3000, warmup: int = 1000, stagger: bool = False, seed: int = 0) -> ClosedLoopStats:
    """N users in a closed loop of fixed-length requests (unique prompts, ignore_eos), one engine
    step per time unit, zero client latency. Stats are sampled after each step, where the engines
    sample their gauges: after finished requests left and before their users resubmit. The window
    is steps [warmup, steps). Users start together (in phase, the worst case) unless `stagger`,
    which spreads their first requests evenly over one output lifetime."""
    return _closed_loop(type(config), astuple(config), prompt_tokens, output_tokens, users,
                        steps, warmup, stagger, seed)


@lru_cache(maxsize=512)
def _closed_loop(kind, fields, P, n_out, users, steps, warmup, stagger, seed) -> ClosedLoopStats:
    sched = make_scheduler(kind(*fields))
    rng = np.random.default_rng(seed)
    count = 0

    def submit() -> None:
        nonlocal count
        prompt = rng.integers(0, VOCAB, P)
        prompt[0] = count % VOCAB  # unique from the first token (no prefix hits)
        sched.add(SimRequest(f"u{count}", prompt.tolist(), n_out))
        count += 1

    starts = sorted((u * n_out // users if stagger else 0) for u in range(users))
    window = max(steps - warmup, 1)
    running, waiting = np.zeros(window, np.int64), np.zeros(window, np.int64)
    usage = np.zeros(window)
    preempt_at_warmup = 0
    for t in range(steps):
        while starts and starts[0] <= t:
            starts.pop(0)
            submit()
        result = sched.step()
        if t == warmup - 1:
            preempt_at_warmup = sched.stats.preemptions_total
        if t >= warmup:
            s = sched.stats
            running[t - warmup], waiting[t - warmup], usage[t - warmup] = s.running, s.waiting, s.usage
        for _ in result.finished:
            submit()
    full = waiting > 0
    return ClosedLoopStats(
        running_mean=float(running.mean()), running_max=int(running.max()),
        waiting_mean=float(waiting.mean()), waiting_max=int(waiting.max()),
        usage_mean=float(usage.mean()),
        usage_at_full=float(usage[full].mean()) if full.any() else float(usage.max()),
        preemptions_per_1k_steps=(sched.stats.preemptions_total - preempt_at_warmup) * 1000 / window,
        steps=window)
