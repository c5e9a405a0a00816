"""The real-time engine loop: schedsim's scheduler stepped against a wall clock.

One asyncio task runs `scheduler.step()`, waits until the step's modelled duration has passed, then
hands the emitted tokens to the waiting streams and updates /metrics, like an engine's
`update_from_output`. The loop keeps a virtual timeline: a step that starts late is made up by the
next one's shorter wait, so the token rate follows the time model exactly while the CPU keeps up.
`behind` (gauge `kvprobe_emulator_step_lag_seconds`) is how far the loop is behind that timeline;
when it exceeds `MAX_BEHIND` the time is given up (counter `kvprobe_emulator_lag_seconds_total`) so
that a stall never turns into a burst. Step lag over a window = (Δlag_seconds_total + Δstep_lag_seconds)
/ Δmodel_seconds_total: the real time the emulator ran past the modelled time, as a fraction of it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

from kvprobe.targets.emulator.tokens import pseudo_eos
from kvprobe.theory.sim.steptime import TimeModel

MAX_BEHIND = 0.25  # seconds behind the timeline before the time is given up (counted as lost)
IDLE_EPSILON = 0.01  # seconds past an idle report's due time at which the loop wakes for it


class Stream:
    """One request as its HTTP handler sees it: tokens arrive in batches, one wake-up per step."""

    __slots__ = ("rid", "trace_id", "prompt_len", "max_tokens", "stream", "t_arrival", "t_first", "t_end",
                 "tokens", "_pending", "finish_reason", "_waiter", "sim", "sink")

    def __init__(self, rid: str, prompt_len: int, max_tokens: int, *, stream: bool, trace_id: str | None,
                 now: float):
        self.rid, self.trace_id, self.prompt_len, self.max_tokens = rid, trace_id, prompt_len, max_tokens
        self.stream = stream
        self.t_arrival, self.t_first, self.t_end = now, None, None
        self.tokens: list[int] = []
        self._pending: list[int] = []
        self.finish_reason: str | None = None
        self._waiter: asyncio.Future | None = None
        self.sim = None
        # sink(token, finish_reason | None) -> bool: writes straight to the client from the engine loop
        # (no task switch per token); False means the client is gone.
        self.sink = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> tuple[list[int], bool]:
        """The tokens delivered since the last call, and whether the request has finished."""
        while not self._pending and not self.done:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        batch, self._pending = self._pending, []
        return batch, self.done


class Runtime:
    """Owns the scheduler loop, the streams by request id, lag accounting and the trace file."""

    def __init__(self, scheduler, time_model: TimeModel, metrics, hooks, *, make_request, seed: int = 0,
                 trace_path: str | None = None, clock=time.monotonic, wall=time.time):
        self.scheduler, self.time_model, self.metrics, self.hooks = scheduler, time_model, metrics, hooks
        self.make_request = make_request  # schedsim.SimRequest
        self.seed = seed
        self.clock, self.wall = clock, wall
        self.streams: dict[str, Stream] = {}
        self._intake: dict[str, object] = {}
        self._serial = itertools.count()
        self._wake = asyncio.Event()
        self._stopping = False
        self._trace = open(trace_path, "a", buffering=1 << 16) if trace_path else None  # noqa: SIM115

    # --- requests
    def submit(self, prompt: list[int], max_tokens: int, *, min_tokens: int = 0, ignore_eos: bool = False,
               stream: bool = True, trace_id: str | None = None, sink=None) -> Stream:
        serial = next(self._serial)
        rid = f"cmpl-{serial:x}-{self.seed:x}"
        s = Stream(rid, len(prompt), max_tokens, stream=stream, trace_id=trace_id, now=self.clock())
        s.sink = sink
        eos = pseudo_eos(self.seed, serial, min_tokens, max_tokens, ignore_eos)
        s.sim = self.make_request(rid=rid, prompt=prompt, max_tokens=max_tokens, ignore_eos=eos is None,
                                  eos_after=eos)
        self.streams[rid] = s
        self._intake[rid] = s.sim  # enters the scheduler between steps, like EngineCore's input queue
        self._wake.set()
        return s

    def abort(self, rid: str) -> None:
        """Client gone: the engine aborts the request and frees its blocks (fault hooks may not)."""
        s = self.streams.get(rid)
        if s is None or s.done:
            return
        if self._intake.pop(rid, None) is None:
            self.hooks.abort(rid)
        self._finish(s, "abort", self.clock())
        self._wake.set()

    def _finish(self, s: Stream, reason: str, now: float) -> None:
        s.finish_reason, s.t_end = reason, now
        self.streams.pop(s.rid, None)
        s._wake()
        self.metrics.on_finished(reason, now - s.t_arrival, s.stream, prompt_tokens=s.prompt_len,
                                 completion_tokens=len(s.tokens))
        if self._trace is not None:
            off = self.wall() - now  # server-side times on the wall clock, comparable with the client's
            self._trace.write(json.dumps({
                "id": s.trace_id, "rid": s.rid, "t_arrival": s.t_arrival + off,
                "t_first": None if s.t_first is None else s.t_first + off, "t_end": now + off,
                "prompt_tokens": s.prompt_len, "completion_tokens": len(s.tokens), "finish_reason": reason}) + "\n")

    # --- the loop
    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    async def run(self) -> None:
        t_virtual = self.clock()
        while not self._stopping:
            self._admit_intake()
            if not self.scheduler.has_work():
                self.metrics.on_idle(self.hooks.snapshot(), self.clock())
                self._wake.clear()
                if not self.scheduler.has_work() and not self._intake:
                    await self._idle()
                t_virtual = self.clock()
                continue
            now = self.clock()
            behind, lost = max(0.0, now - t_virtual), 0.0
            if behind > MAX_BEHIND:
                lost, t_virtual, behind = behind, now, 0.0
            result = self.scheduler.step()
            duration = self.time_model.step_seconds(result.prefill_tokens, result.decode_seqs)
            t_virtual += duration
            delay = t_virtual - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # let handlers run even when behind
            self._deliver(result)
            self.metrics.on_lag(max(0.0, self.clock() - t_virtual), lost, duration)
        self.close()

    async def _idle(self) -> None:
        """Sleep until a request arrives, or until the engine's next idle report is due (SGLang
        republishes its gauges while idle: engines/sglang/metrics.py IDLE_REPORT_SECONDS)."""
        due = self.metrics.idle_report_due(self.clock())
        if due is None:
            await self._wake.wait()
            return
        try:  # a timer may fire a hair early: the idle pass that follows must find the interval passed
            await asyncio.wait_for(self._wake.wait(), timeout=due + IDLE_EPSILON)
        except TimeoutError:
            pass

    def _admit_intake(self) -> None:
        if self._intake:
            intake, self._intake = self._intake, {}
            for rid, req in intake.items():
                try:
                    self.hooks.add(req)
                except ValueError:
                    # schedsim refuses a request with no room to generate (SGLang clips max_new_tokens to
                    # 0): the engine finishes it after prefill with no output. Never let it kill the loop.
                    s = self.streams.get(rid)
                    if s is not None:
                        self._finish(s, "length", self.clock())

    def _deliver(self, result) -> None:
        now = self.clock()
        touched, gone = set(), []
        finishing = {req.rid for req in result.finished}
        streams = self.streams
        for req, token in result.emitted:
            s = streams.get(req.rid)
            if s is None:
                continue
            if s.t_first is None:
                s.t_first = now
                self.metrics.on_first_token(now - s.t_arrival, s.stream)
            s.tokens.append(token)
            if s.sink is None:
                s._pending.append(token)
                touched.add(s)
                continue
            reason = None
            if req.rid in finishing:
                reason = "length" if len(s.tokens) >= s.max_tokens else "stop"
            if not s.sink(token, reason):
                gone.append(s.rid)
        for req in result.finished:
            s = streams.get(req.rid)
            if s is not None:
                self._finish(s, "length" if len(s.tokens) >= s.max_tokens else "stop", now)
        for s in touched:
            s._wake()
        for rid in gone:
            self.abort(rid)
        self.hooks.after_step(result)
        self.metrics.on_step(self.hooks.snapshot(), prefill_tokens=result.prefill_tokens,
                             decode_seqs=result.decode_seqs, emitted=len(result.emitted), now=now)
