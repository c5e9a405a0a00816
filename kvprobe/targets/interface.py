"""What every probe target is to the probe: one small interface, whatever runs behind the URL.

A target is opened from an expectation (`open`: start the engine, or reach one that runs), says
what the engine reports about itself (`facts`: version, reported capacity, limits), hands out the
/metrics sampler for its series (`sampler`), and is closed (`close`: stops what it started). The
load goes to `url` with `headers`, prompts as `prompt_format` ("ids" or "text") take them.

The kinds: a launched or attached engine and the emulator (`kvprobe.targets.launch.Target`), a
shadow engine (`kvprobe.targets.shadow.target.ShadowTarget`), and a fleet of replicas behind a
router (`kvprobe.targets.fleet.target.FleetTarget`). `kvprobe.targets.open` picks the kind an
expectation names; nothing after it asks which kind it holds.

A kind may predict and judge more than one engine does: `ledger` turns one engine's ledger into
the target's (a fleet's: R replicas behind its router's policy), `analyse` and `checks` add the
target's own figures and checks (a fleet's per-replica ones), and `pools` says how many engines'
KV pools the sampled series sums. `OneEngine` is all of these for a single engine: nothing added.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvprobe.observe.sampler import Sampler
    from kvprobe.targets.facts import EngineFacts


@dataclass(frozen=True)
class OpenHow:
    """What the caller adds to the expectation's own `target:` when opening it."""

    artifacts: Path  # the engine's log (and a fleet's replica and router logs) go here
    url: str | None = None  # attach here instead (the --url option); a fleet attaches as its spec says
    engine_command: tuple[str, ...] | None = None  # replaces the engine's binary for `launch: engine`


@runtime_checkable
class ProbeTarget(Protocol):
    url: str  # where the load and one-off requests go
    headers: dict[str, str]  # request headers (an API key): never print them
    prompt_format: str  # "ids" (token-id prompts) or "text" (behind a router that refuses ids)
    pools: int  # the engines' KV pools the sampled series sums
    one_engine: bool  # the series is one engine's: one engine's ledger predicts its counters

    @property
    def dialect(self): ...  # the engine's dialect module (kvprobe.engines)

    @classmethod
    def open(cls, exp, how: OpenHow) -> ProbeTarget: ...

    def facts(self) -> EngineFacts: ...

    def sampler(self, *, interval: float) -> Sampler: ...

    def alive(self) -> bool: ...

    def log_tail(self) -> str: ...

    def close(self) -> None: ...

    # what the target adds to the prediction, the analysis and the checks

    @classmethod
    def ledger(cls, exp, one_engine_ledger): ...

    def analyse(self, pr, pool_units: int | None) -> None: ...

    def checks(self, pr, pool_units: int | None, unit: str) -> dict: ...


class OneEngine:
    """The prediction, analysis and checks of one engine: nothing beyond the probe's own."""

    prompt_format = "ids"
    pools = 1
    # the series is one engine's, so one engine's ledger predicts its preemption counter
    one_engine = True

    @classmethod
    def ledger(cls, exp, one_engine_ledger):
        return one_engine_ledger

    def analyse(self, pr, pool_units: int | None) -> None:
        return None

    def checks(self, pr, pool_units: int | None, unit: str) -> dict:
        return {}
