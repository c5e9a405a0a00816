"""The engine's own figure beside the ledger's and the measurement: three numbers for one shape.

An operator reads the engine's capacity line (vLLM `GPU KV cache size: N tokens`, SGLang
`max_total_num_tokens=N, ... max_running_requests=M`) and divides: N tokens / (P + O) tokens per
request, at most the request cap, is how many requests "fit". That reading is the engine's claim
here. It is not the engine's admission rule, and this module says where the two part and why:

- vLLM admits a request when its prompt fits (0.19 and later: the whole prompt; before: its first
  chunk) and grows its blocks as it decodes, so at any moment the running requests hold fewer than
  P + O tokens each and more of them run than N / (P + O), until preemption evicts some;
- SGLang reserves each request's remaining output at admission (scaled by new_token_ratio before
  0.5.22 for ignore_eos requests), so its claim and its admission are close — unless the request cap
  was clamped (`max_running_requests` at most the pool's tokens // 2, kv_cache_configurator.py
  `resolve_max_num_reqs`, 0.5.23);
- a hybrid model's token line is not its admission: vLLM sums its KV cache groups into one line
  (a request needs blocks in every group), SGLang's line counts the full-attention pool only.

`engine_claim` builds the claim from either what the ledger says the engine will log or what a
running engine reported; `figures` sets the three side by side and names what misleads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvprobe.engines import get_dialect


def _cap_name(engine: str) -> str:
    """The engine's request cap as its logs and config name it (max_num_seqs, max_running_requests)."""
    return get_dialect(engine).REQUEST_CAP_FLAG.replace("-", "_")


@dataclass(frozen=True)
class EngineClaim:
    """What the engine's own figures suggest for requests of `per_request` tokens."""

    engine: str
    tokens: int  # the pool as the engine states it
    max_running: int | None  # the request cap as the engine states it
    per_request: int  # P + O
    source: str  # where the figures were read: "startup log", "metrics: ...", "the ledger (what the engine will log)"

    @property
    def requests(self) -> float:
        fit = self.tokens / self.per_request
        return fit if self.max_running is None else min(fit, float(self.max_running))

    @property
    def how(self) -> str:
        text = f"{get_dialect(self.engine).POOL_LINE} {self.tokens:,} tokens / {self.per_request:,} per request"
        if self.max_running is not None and self.max_running < self.tokens / self.per_request:
            text = f"{_cap_name(self.engine)} {self.max_running:,} (below {text})"
        return text


def engine_claim(engine: str, tokens: int | None, max_running: int | None, prompt_tokens: int, output_tokens: int,
                 source: str) -> EngineClaim | None:
    """The claim, or None when the engine stated no pool."""
    if tokens is None or tokens <= 0:
        return None
    return EngineClaim(engine, int(tokens), None if max_running is None else int(max_running),
                       prompt_tokens + output_tokens, source)


def claim_from_reported(engine: str, reported, prompt_tokens: int, output_tokens: int) -> EngineClaim | None:
    """The claim of a running engine (`ReportedCapacity`): its pool line, or blocks x block size."""
    tokens, where = reported.kv_tokens, reported.sources.get("kv_tokens")
    if tokens is None and reported.num_blocks is not None and reported.block_size is not None:
        tokens, where = reported.num_blocks * reported.block_size, reported.sources.get("num_blocks")
    return engine_claim(engine, tokens, reported.max_running, prompt_tokens, output_tokens,
                        where or "the engine's report")


@dataclass
class Figures:
    """The engine's claim, the ledger's limit and the measured rejection point, for one shape."""

    claim: EngineClaim | None
    ledger: float | None
    measured: float | None = None
    uncertainty: float | None = None
    binding: str | None = None
    misleads: list[str] = field(default_factory=list)

    def line(self) -> str:
        parts = []
        if self.claim is not None:
            parts.append(f"the engine's figures {self.claim.requests:.1f} ({self.claim.how}; {self.claim.source})")
        else:
            parts.append("the engine's figures: none published")
        if self.ledger is not None:
            parts.append(f"the ledger {self.ledger:.1f}" + (f" ({self.binding} binds)" if self.binding else ""))
        if self.measured is not None:
            parts.append(f"measured {self.measured:.1f}"
                         + ("" if self.uncertainty is None else f" ± {self.uncertainty:.1f}"))
        per = self.claim.per_request if self.claim is not None else None
        head = "concurrent requests" + (f" of {per:,} tokens" if per else "")
        line = f"{head}: " + " | ".join(parts)
        if self.misleads:
            line += "; the engine's own figure misleads: " + "; ".join(self.misleads)
        return line

    def to_dict(self) -> dict:
        claim = None if self.claim is None else {**asdict(self.claim), "requests": round(self.claim.requests, 2),
                                                 "how": self.claim.how}
        return {"engine_claim": claim, "ledger": self.ledger, "measured": self.measured,
                "uncertainty": self.uncertainty, "binding": self.binding, "misleads": list(self.misleads)}


def figures(claim: EngineClaim | None, *, ledger_limit: float | None, binding: str | None = None,
            measured: float | None = None, uncertainty: float | None = None, hybrid: str | None = None,
            cap_given: int | None = None, tolerance: tuple[float, float] = (1.0, 0.05)) -> Figures:
    """The three figures, and why the engine's claim misleads when it does. The claim is held
    against the measurement when there is one, else against the ledger; `tolerance` is the
    rejection point's (absolute requests, relative). `hybrid`: the model's KV cache groups or pools
    (their names) when it has several; `cap_given`: the request cap the engine was started with."""
    out = Figures(claim, None if ledger_limit is None else round(float(ledger_limit), 2),
                  None if measured is None else round(float(measured), 2),
                  None if uncertainty is None else round(float(uncertainty), 2), binding)
    if claim is None:
        return out
    if cap_given is not None and claim.max_running is not None and claim.max_running < cap_given:
        out.misleads.append(f"{_cap_name(claim.engine)} {cap_given:,} was given, the engine clamped it to "
                            f"{claim.max_running:,}" + (" (at most the pool's tokens // 2)" if claim.engine == "sglang"
                                                        else ""))
    reference, said = (measured, "measured") if measured is not None else (ledger_limit, "the ledger")
    if reference is None:
        return out
    allowance = max(tolerance[0], tolerance[1] * abs(reference))
    gap = reference - claim.requests
    if abs(gap) <= allowance:
        return out
    share = gap / claim.requests
    if hybrid:
        out.misleads.append(f"{said} {reference:.1f} is {share:+.0%} off it: "
                            + _HYBRID[claim.engine].format(groups=hybrid))
    elif gap > 0:
        out.misleads.append(f"{said} {reference:.1f} is {share:+.0%} above it: " + _ABOVE[claim.engine])
    elif binding not in (None, "kv"):
        out.misleads.append(f"{said} {reference:.1f} is {share:+.0%} below it: the {binding} limit binds before "
                            "the pool")
    else:
        out.misleads.append(f"{said} {reference:.1f} is {share:+.0%} below it: " + _BELOW[claim.engine])
    return out


_ABOVE = {
    "vllm": "a request holds its P + O tokens only at its last step; admitted once its prompt fits, it grows a "
            "block at a time, so requests at every stage of their output run together until preemption evicts some",
    "sglang": "SGLang reserves the remaining output scaled by new_token_ratio (below 1 for ignore_eos requests "
              "before 0.5.22), admitting more than the pool holds at their peak and retracting when it runs out",
}
_BELOW = {
    "vllm": "admission holds back more than the tokens a request uses (whole blocks of the prompt, "
            "preemption cycles that leave blocks idle)",
    "sglang": "admission reserves more than a request holds (whole pages, the output reserved in full)",
}
_HYBRID = {
    "vllm": "a hybrid model ({groups}): the token line sums its KV cache groups, and a request needs blocks in "
            "every group — the admission limit is the ledger's, not this line's",
    "sglang": "a hybrid model ({groups}): the token line counts the full-attention pool only; the other pools "
              "bind admission too — the admission limit is the ledger's, not this line's",
}
