"""Release changes kvprobe has no model for, as data: each engine's theory package holds one table of
them (`kvprobe/theory/vllm/unmodelled.py`, `kvprobe/theory/sglang/unmodelled.py`), and the ledger asks
it with the version and its inputs. A row applies when the version is on the side of the change that
kvprobe does not model *and* the inputs reach the changed behaviour; the ledger then says so ("not
modelled since vLLM 0.20.0: ...") instead of predicting with the other side's rule.

The entries are those of the engines' release notes kept beside the project
(`release-changes.md`: V1-V15 vLLM, S1-S10 SGLang; V16 read in vLLM 0.34.0's wheel); docs/ledger.md
has the table of all 26 with where kvprobe models each one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# What a change moves, and so what the ledger does when a row applies:
#   startup   - whether the engine starts at all: the admission is not predicted
#   pool      - the KV pool's size: the admission is not predicted (the tables stay, with the line)
#   admission - the admission limit or plateau: the admission is not predicted
#   figure    - a figure the engine reports (its KV cache size line): the line only, the prediction stands
EFFECTS = ("startup", "pool", "admission", "figure")
SIDES = ("since", "before")


@dataclass(frozen=True)
class Unmodelled:
    """One release change kvprobe has no model for.

    side "since": kvprobe holds the rule of the releases before `release`, and `release` onward
    is not modelled; "before": kvprobe holds `release`'s (and 0.33.0's / 0.5.23's) rule, and the
    releases before it are not modelled."""

    entry: str  # the release-changes.md entry: "V4", "S5"
    engine: str  # "vLLM" | "SGLang", as the line names it
    release: str  # the first release with the change (read in its wheel: `sources`)
    side: str
    effect: str
    what: str
    sources: tuple[str, ...]
    triggered: Callable[[object], bool]  # the inputs reach the changed behaviour (the engine's facts object)

    def __post_init__(self) -> None:
        if self.side not in SIDES or self.effect not in EFFECTS:
            raise ValueError(f"{self.entry}: expected side in {SIDES} and effect in {EFFECTS}, "
                             f"got {self.side!r} / {self.effect!r}")

    def on_changed_side(self, version_key: tuple, release_key: tuple) -> bool:
        return version_key >= release_key if self.side == "since" else version_key < release_key

    def line(self) -> str:
        return f"not modelled {self.side} {self.engine} {self.release}: {self.what}"


def applying(rows: Sequence[Unmodelled], facts, key: Callable[[str], tuple]) -> list[Unmodelled]:
    """The rows whose changed side holds `facts.version` and whose inputs trigger, in table order."""
    mine = key(facts.version)
    return [r for r in rows if r.on_changed_side(mine, key(r.release)) and r.triggered(facts)]


def blocks_prediction(rows: Sequence[Unmodelled]) -> bool:
    """Whether any of these rows moves what the admission prediction rests on."""
    return any(r.effect != "figure" for r in rows)
