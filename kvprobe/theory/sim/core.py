"""What both engines' schedulers share: configs, requests, step results, stats, the lanes of
running requests held as numpy columns, and the base class. See kvprobe/theory/schedsim.py."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvprobe.theory.sglang.releases import MAX_PREFILL_TOKENS
from kvprobe.theory.sim.pools import VOCAB, rid_seed
from kvprobe.theory.vllm.hybrid.block_pool import SPLIT

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
    async_scheduling: bool = False  # AsyncScheduler + batch queue of 2 (the engine's default: engines/vllm.py)
    # the model's KV cache groups (vllm/hybrid/block_pool.KVGroup), in the planner's order; () = one full-attention
    # group. A hybrid model (window, chunked-local or Mamba groups) runs vllm/hybrid/scheduler.py.
    groups: tuple = ()
    # window groups under older releases' rules (theory/vllm/releases.py WindowRules; 0.33.0's by default):
    # the full-sequence check caps their charge (0.20.0 on); async's second batch counts in the cap and
    # what left the window is freed on processed tokens (0.26.0 on)
    window_admission_cap: bool = True
    window_in_flight: bool = True
    # a hybrid model's block pool (theory/vllm/releases.py UNHASHED_FIRST_FROM, SPARSE_RETENTION_FROM):
    # `sparse_retention`, a window / Mamba group caches only the blocks a later hit can use (0.29.0 on), or
    # every full block; `free_order`, which frees send the blocks without a hash to the head of the free
    # queue (vllm/hybrid/block_pool.py SPLIT, 0.24.0 on; WINDOW_SPLIT, 0.23.x; TAIL, none)
    sparse_retention: bool = True
    free_order: str = SPLIT


@dataclass
class SglangConfig:
    max_total_num_tokens: int
    page_size: int = 1
    max_running_requests: int = 2048
    chunked_prefill_size: int = 8192  # <= 0: disabled
    max_prefill_tokens: int = MAX_PREFILL_TOKENS
    context_len: int = 8192
    disable_radix_cache: bool = False
    policy: str = "sglang-0.5.22"  # "sglang-0.5.22" (ignore_eos reserved at 1.0) | "sglang-0.5.21" (new_token_ratio)
    schedule_conservativeness: float = 1.0
    overlap: bool = True
    # scheduler-loop rules of older releases (kvprobe/theory/sglang/releases.py scheduler_rules); the
    # defaults are 0.5.23's: a finished request leaves the batch at the next decode step (<= 0.5.22),
    # a request whose in-flight token is its last is decoded once more (overlap, <= 0.5.21)
    finished_leave_at_decode: bool = False
    decode_finishing_inflight: bool = False
    # hybrid sliding-window models (sglang/swa/scheduler.py): the window SGLang's scheduler uses (gpt-oss:
    # sliding_window - 1) and the window pool's tokens (max_total_num_tokens_swa); None: one pool
    sliding_window_size: int | None = None
    swa_pool_tokens: int | None = None


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
    _keys: list = field(default_factory=list, init=False, repr=False)  # vLLM: prompt keys it holds
    _own: int = field(default=0, init=False, repr=False)  # vLLM: own (output) blocks it holds from a hit
    _runs: list = field(default_factory=list, init=False, repr=False)  # vLLM: its own blocks left cached
    _stop: int = field(default=0, init=False, repr=False)
    _maxn: int = field(default=0, init=False, repr=False)  # SGLang max_new_tokens after clipping
    _tokens: tuple = field(default=(), init=False, repr=False)  # SGLang: the prompt, for the radix tree
    _node: object = field(default=None, init=False, repr=False)  # SGLang: the tree node it locks
    _cached: int = field(default=0, init=False, repr=False)  # SGLang: prompt tokens held by the tree
    _stashed: int = field(default=0, init=False, repr=False)  # SGLang: tokens of its chunks checkpointed
    _out_ids: tuple = field(default=(), init=False, repr=False)  # SGLang: its output ids, as far as asked
    _kv: object = field(default=None, init=False, repr=False)  # vLLM hybrid: its vllm/hybrid/block_pool.KVRequest


class Emitted(Sequence):
    """`StepResult.emitted`: a list-like of (request, token id), built only when read."""

    def __init__(self, reqs: np.ndarray | None = None, seeds: np.ndarray | None = None,
                 index: np.ndarray | None = None):
        self._reqs = reqs if reqs is not None else np.empty(0, dtype=object)
        self._seeds, self._index = seeds, index  # the token ids are computed when read
        self._extra: list[tuple[SimRequest, int]] = []

    def __len__(self) -> int:
        return len(self._reqs) + len(self._extra)

    def __getitem__(self, i):
        return list(self)[i]

    def __iter__(self):
        if len(self._reqs):
            tokens = output_tokens(self._seeds, self._index)
            yield from zip(self._reqs.tolist(), tokens.tolist(), strict=True)
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
    no_token_total: int = 0  # SGLang: admission passes stopped by a candidate that did not fit
    window_no_token_total: int = 0  # ... of those, stopped by the window pool (hybrid SWA)
    swa_used_tokens: int = 0  # SGLang hybrid SWA: the window pool's used tokens and size
    swa_pool_tokens: int = 0
    # SGLang hybrid SWA, radix cache on: retracted requests that came back to their prompt still in
    # the tree (re-adopted by SGLang in a way not modelled: the trace is not exact from the first)
    swa_radix_readopted: int = 0


def output_tokens(seeds: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Output token id number `index` (0-based) of each request: a function of rid and position
    only, so simulation and emulation produce (and cache) the same tokens."""
    return (seeds + index * 40503 + 17) % VOCAB


class Lanes:
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
        idx = mask.nonzero()[0]
        for a in self.cols.values():
            a[: len(idx)] = a[: self.n][idx]
        self.reqs[: len(idx)] = self.reqs[: self.n][idx]
        self.reqs[len(idx) : self.n] = None
        self.n = len(idx)

    def pop(self) -> None:
        """Drop the last row (a preempted request leaves from the end of the running order)."""
        self.n -= 1
        self.reqs[self.n] = None

    def index(self, req: SimRequest) -> int:
        for i in range(self.n):
            if self.reqs[i] is req:
                return i
        raise KeyError(req.rid)


class SchedulerBase:
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
        self.refresh_stats()

    def _finish_reason(self, req: SimRequest) -> str:
        eos = not req.ignore_eos and req.eos_after is not None and req.output_len >= req.eos_after
        return "stop" if eos else "length"
