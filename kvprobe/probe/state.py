"""The state of one probe while it runs (`ProbeRun`): what every step reads and leaves."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvprobe.probe.result import ProbeOptions, ProbeResult


@dataclass
class ProbeRun:
    """Everything one probe holds while it runs. `run_probe` moves it through named steps
    (reach the engine, start the load, ramp, stop the load, analyse, judge, close); each step
    reads what it needs from here and leaves what it produced."""

    exp: object  # the Expectation, overrides applied
    options: ProbeOptions
    artifacts: Path
    result: ProbeResult
    ledger: object  # theory.ledger.Ledger
    dialect: object  # the engine's dialect module, resolved once
    deadline: float  # time.monotonic() by which the ramp must end
    target: object = None  # targets.interface.ProbeTarget
    load: object = None  # load.runner.LocustRun
    sampler: object = None  # observe.Sampler
    hold: float = 0.0  # seconds per level
    lifetime: float | None = None  # seconds one request takes alone (calibration)
    windows: list = field(default_factory=list)  # analysis.LevelWindow per level run
    jitters: list = field(default_factory=list)  # the start jitter (s) of each level's new users, as windows
    series: object = None  # observe.TimeSeries once the sampler stopped
    records: list = field(default_factory=list)  # load.records.Record, once Locust stopped
    replica_series: list | None = None  # a fleet: each replica's observe.TimeSeries, once the sampler stopped
    t_stop: float | None = None  # when the load stopped (the drain is watched from here)
    starvation: object = None  # analysis.client.Starvation: the levels a saturated load generator served

    @property
    def prediction(self):
        return self.ledger.admission

    @property
    def model(self) -> str:
        return self.exp.served_model_name or self.exp.model

    def log(self, line: str) -> None:
        self.options.log(line)
