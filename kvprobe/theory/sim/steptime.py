"""How long one engine step takes when there is no model: the time model shared by every target
that fakes the forward pass (the emulator, the vLLM shadow worker, the SGLang shadow plugin).

One model for all of them means a probe of the emulator and a probe of the real scheduler see the
same request lifetimes, so their figures can be set side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class TimeModel:
    """Modelled duration of one engine step: a fixed cost plus prefill and decode terms."""

    step_ms: float = 5.0
    prefill_us_per_token: float = 1.0
    decode_us_per_seq: float = 20.0

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        return (self.step_ms * 1e3 + self.prefill_us_per_token * prefill_tokens
                + self.decode_us_per_seq * decode_seqs) / 1e6

    def encode(self) -> str:
        """`step_ms=5.0,prefill_us_per_token=1.0,decode_us_per_seq=20.0`: how it crosses a process
        boundary (an environment variable read inside the engine's own processes)."""
        return ",".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))

    @classmethod
    def decode(cls, text: str) -> TimeModel:
        known = {f.name for f in fields(cls)}
        values = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name not in known:
                raise ValueError(f"time model: expected name=value with name in {sorted(known)}, got {item!r}")
            values[name] = float(value)
        return cls(**values)
