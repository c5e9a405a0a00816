"""The model-less device of the SGLang shadow: when a step ends, and which token it "samples".

Pure Python (no torch, no SGLang), so that it is unit-tested in kvprobe's own environment; the
forward replacement in `sglang_hooks.py` drives it from inside SGLang's scheduler process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

# Token ids are taken from the middle of the vocabulary: control tokens sit at its ends (Mistral's
# [control_N] at 0-770, Llama 3's specials from 128000, Qwen's from 151643), and the word-level
# tokenizer of kvprobe's model folder marks its unknown token t0 special.
TOKEN_SPREAD = 251  # ids vary with the position over this many words, so streamed text is not one word


class DeviceTimeline:
    """When each modelled step starts and ends, and how long a forward call must block.

    SGLang's overlap scheduler (on by default; `event_loop_overlap`, scheduler.py L2061-2135) launches
    batch N+1 before it processes the result of batch N, and on a GPU it then waits for N to finish.
    Blocking in forward(N+1) until N ends is therefore blocking where the GPU run would: a step takes
    max(scheduler's own time, modelled step time), as on a GPU, and a batch starts when the device is
    free. Without overlap (`--disable-overlap-schedule`) a forward is synchronous: it returns when its
    own step ends.
    """

    def __init__(self, step_seconds: Callable[[int, int], float], *, overlap: bool,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.step_seconds, self.overlap, self.clock, self.sleep = step_seconds, overlap, clock, sleep
        self.busy_until = float("-inf")
        self.steps = 0
        self.blocked_seconds = 0.0
        self.model_seconds = 0.0
        self.busy_seconds = 0.0  # real time between consecutive steps, idle gaps (> IDLE_GAP) left out
        self._last_call: float | None = None

    IDLE_GAP = 0.5

    def run(self, prefill_tokens: int, decode_seqs: int) -> None:
        now = self.clock()
        if self._last_call is not None and now - self._last_call < self.IDLE_GAP:
            self.busy_seconds += now - self._last_call
        self._last_call = now
        previous_end = self.busy_until
        step = self.step_seconds(prefill_tokens, decode_seqs)
        self.busy_until = max(now, previous_end) + step
        self.steps += 1
        self.model_seconds += step
        until = previous_end if self.overlap else self.busy_until
        if until > now:
            self.blocked_seconds += until - now
            self.sleep(until - now)

    def window(self) -> tuple[int, float, float, float]:
        """(steps, real busy seconds, modelled seconds, seconds waiting for the device) since the
        last call."""
        out = (self.steps, self.busy_seconds, self.model_seconds, self.blocked_seconds)
        self.steps, self.busy_seconds, self.model_seconds, self.blocked_seconds = 0, 0.0, 0.0, 0.0
        return out


def special_ids(*values) -> frozenset[int]:
    """The ids a config names (bos/eos/pad: an int, a list of ints or None each)."""
    out: set[int] = set()
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool):
            out.add(v)
        elif isinstance(v, list | tuple):
            out.update(x for x in v if isinstance(x, int) and not isinstance(x, bool))
    return frozenset(out)


def pseudo_token_ids(seq_lens: Iterable[int], vocab_size: int, special: frozenset[int]) -> list[int]:
    """One token id per request, varied by its position, below the vocabulary, never a special id."""
    base = vocab_size // 2
    out = []
    for n in seq_lens:
        tid = base + int(n) % TOKEN_SPREAD
        for _ in range(len(special)):  # the next id that is not special (at most len(special) steps)
            if tid not in special:
                break
            tid = (tid + 1) % vocab_size
        out.append(tid)
    return out
