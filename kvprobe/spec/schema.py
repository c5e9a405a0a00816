"""What a loaded profile and expectation hold: the frozen records the spec parsers build
(kvprobe.spec.profile, kvprobe.spec.target, kvprobe.spec.expectation) and the names they accept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvprobe.spec.gpus import find_gpu
from kvprobe.targets.emulator.faults import FAULTS

CHECKS = ("rejection_point", "reported_capacity", "no_preemption", "leak", "usage_gap", "length_limit", "exactness")
FLEET_CHECKS = ("replica_leak", "replica_usage", "router_imbalance")  # a fleet target only (kvprobe/verdict/fleet.py)
RAMP_STRATEGIES = ("explicit", "around-prediction", "bisect", "predict")
# Fault names of `kvprobe emulate --fault NAME`; each makes one check fail (the emulator owns them).
EMULATOR_FAULTS = tuple(FAULTS)
MIN_STEADY_SAMPLES = 3  # samples after warm-up that a level needs for a steady-state mean
ESTIMATE_KEYS = ("activation_bytes", "cudagraph_bytes", "other_bytes")


@dataclass(frozen=True)
class RequestShape:
    prompt_tokens: int
    output_tokens: int
    stream: bool = True
    shared_prefix_tokens: int = 0  # K: the first K prompt tokens are the same in every request of a probe


@dataclass(frozen=True)
class RampSpec:
    strategy: str  # "explicit" | "around-prediction" | "bisect" | "predict"
    levels: tuple[int, ...] = ()
    below: int = 4
    window: int = 2
    above: int = 2
    max_users: int | None = None
    confirm: int = 1
    # predict: the rejection point's ~95% half-width, in requests, the ramp holds and adds deep levels
    # for at most (None: what a safe verdict needs, strategy.SAFE_SHARE of the allowance)
    uncertainty: float | None = None


@dataclass(frozen=True)
class HoldSpec:
    seconds: float | None
    lifetimes: float | None
    warmup: float = 0.3  # fraction of each level's hold discarded before steady-state means


@dataclass(frozen=True)
class WorkersSpec:
    """Load from other hosts: the master starts no load process and waits for `expect` workers
    (`kvprobe worker --master HOST:PORT`) on `host:port` for at most `wait_seconds`."""

    expect: int
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port, chosen when the probe starts and printed
    wait_seconds: float = 60.0


@dataclass(frozen=True)
class Profile:
    name: str
    path: str | None
    request: RequestShape
    ramp: RampSpec
    hold: HoldSpec
    sample_interval: float = 0.1
    budget_seconds: float = 120
    drain_seconds: float = 10
    processes: int = 1
    description: str = ""
    workers: WorkersSpec | None = None  # load from `kvprobe worker` processes instead of local ones


@dataclass(frozen=True)
class Tolerances:
    reported_capacity: float = 0.01  # relative
    rejection_point: float = 1.0  # absolute, requests
    rejection_point_relative: float = 0.05
    usage_gap: float = 0.05  # absolute, gauge units (0..1)


@dataclass(frozen=True)
class Target:
    mode: str  # "emulator" | "launch" | "shadow" | "url"
    command: tuple[str, ...] | None = None  # argv prefix (the engine binary) for mode "launch"
    url: str | None = None
    api_key_env: str | None = None  # the NAME of an environment variable, never the key
    startup_timeout: float = 600
    port: int | None = None
    emulator: dict = field(default_factory=dict)  # step_ms, prefill_us_per_token, decode_us_per_seq, seed, faults, args
    env: dict = field(default_factory=dict)  # extra environment of a launched engine (target.env)
    model: str | None = None  # what `launch: engine` loads, when not the theory's `model`
    time_model: dict = field(default_factory=dict)  # `launch: shadow`: step_ms, prefill_us_per_token, decode_us_per_seq
    engine_args: tuple[str, ...] = ()  # `launch: shadow`: appended to the engine's command, unseen by the theory
    # `fleet:` replicas, router, policy (+ replica_urls attached); {}: one engine
    fleet: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Hardware:
    gpu_memory_bytes: int | None = None
    gpu_count: int = 1
    name: str | None = None
    gpu_free_memory_bytes: int | None = None  # free when the engine starts (a shared card); None: all of it

    @property
    def capability(self) -> str | None:
        """The named card's compute capability (spec/gpus.py); None where no card is named."""
        return None if self.name is None else find_gpu(self.name, key="hardware.gpu").capability


@dataclass(frozen=True)
class StagingRecord:
    """What an attached probe measured (`staging:` of a repro.yaml, kvprobe.probe.repro): the replay
    on a shadow engine is compared with it."""

    rejection_point: float | None  # the running plateau; None: no level saturated the engine
    uncertainty: float | None = None  # its ~95% half-width
    preemptions: float | None = None  # over the saturated levels; None: the counter was absent
    running: dict = field(default_factory=dict)  # users -> the level's steady running mean
    url: str | None = None  # where the engine was (credentials never written)
    result: str | None = None  # the staging run's result.json


# What `kvprobe diff` compares between releases (kvprobe.probe.diff_changes.QUANTITIES), as `expect_change:` names it.
CHANGE_KEYS = ("startup", "pool", "rejection_point", "preemptions", "usage", "binding", "capacity_line")


@dataclass(frozen=True)
class Expectation:
    name: str
    path: str
    engine: str
    version: str
    model: str
    model_base_dir: str
    served_model_name: str | None
    flags: dict
    hardware: Hardware
    target: Target
    profile: Profile
    tolerances: Tolerances
    checks: tuple[str, ...]
    expect_fail: str | None = None
    description: str = ""
    enabled: bool = True  # `enabled: false`: collected, skipped with a reason
    model_config: str | None = None  # config.json for the theory when `model` is not a preset
    estimates: dict = field(default_factory=dict)  # ledger overrides of non-KV terms, bytes
    policy: str | None = None  # an admission policy chosen explicitly (required for an unknown version)
    staging: StagingRecord | None = None  # a repro.yaml: what the attached probe it replays measured
    versions: tuple[str, ...] = ()  # `versions: [A, B]`: probed on each release (pytest: one item per release)
    expect_change: tuple[str, ...] = ()  # CHANGE_KEYS that must change between consecutive releases
    repeat: int = 1  # `repeat: N`: each of `versions` run N times in a row (kvprobe diff --repeat)

    @property
    def served_name(self) -> str:
        """The model name clients send (and the engine must serve): `served_model_name`, else `model`."""
        return self.served_model_name or self.model

    @property
    def launched_model(self) -> str:
        """What a launched engine loads: `target.model` when given, else the theory's `model`."""
        return self.target.model or self.model
