"""What every engine dialect module provides, and the engine-neutral records built from it.

A dialect package (`kvprobe/engines/vllm/`, `kvprobe/engines/sglang/`) is the one place where
the facts about an engine are written: metric names, flags, log formats, error bodies, endpoint
shapes, each with the engine version and source file it comes from. Everything else (emulator,
sampler, launcher, tests) reads them from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

from kvprobe.releases import version_tuple


@dataclass(frozen=True)
class MetricMap:
    """Prometheus family names of the common time-series schema, in one engine's dialect.

    Names are *family* names as `prometheus_client.parser.text_string_to_metric_families`
    yields them (a counter `x_total` is family `x`). `None` means the engine has no such metric.
    """

    running: str
    waiting: str
    usage: str  # the dashboard gauge, 0..1
    usage_fallbacks: tuple[str, ...] = ()  # older names, tried in order when `usage` is absent
    waiting_capacity: tuple[str, dict[str, str]] | None = None  # (family, label filter)
    preemptions: str | None = None  # counter family (vLLM preemptions, SGLang retractions)
    used_tokens: str | None = None  # gauge of KV tokens in use
    pool_tokens: str | None = None  # gauge of the pool size in tokens
    ttft: str | None = None  # histogram family
    success: str | None = None  # counter family of finished requests
    extra: dict[str, str] = field(default_factory=dict)  # dialect-specific names by role


@dataclass(frozen=True)
class ReportedCapacity:
    """What the engine itself says about its pool: from its startup log and its info endpoints."""

    kv_tokens: int | None = None  # vLLM "GPU KV cache size: N tokens"; SGLang max_total_num_tokens
    num_blocks: int | None = None  # vLLM num_gpu_blocks (includes the null block)
    block_size: int | None = None  # vLLM block_size / SGLang page_size
    max_concurrency: float | None = None  # vLLM "Maximum concurrency for L tokens per request: Xx"
    max_model_len: int | None = None  # vLLM max_model_len / SGLang context_len
    max_running: int | None = None  # max_num_seqs / max_running_requests
    token_budget: int | None = None  # max_num_batched_tokens / chunked_prefill_size
    max_req_input_len: int | None = None  # SGLang only
    version: str | None = None
    served_model_name: str | None = None  # the id clients send (/v1/models `id`)
    model_path: str | None = None  # what the engine loaded (vLLM /v1/models `root`, SGLang `model_path`)
    # The engine's own flags as it publishes them, by their real names without `--` (the names an
    # expectation writes): {"block-size": 16, "num-gpu-blocks-override": None, ...}. None means the
    # engine says the flag was not given (it runs its default); a flag absent here is not published.
    flags: dict[str, object] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # field (or "flags.NAME") -> where it was read

    def value(self, name: str) -> object:
        """A field by name, or a published flag as "flags.NAME" (the keys of `sources`)."""
        if name.startswith("flags."):
            return self.flags.get(name[len("flags."):])
        return getattr(self, name)

    def merged(self, other: ReportedCapacity) -> ReportedCapacity:
        """Fields of `other` fill the gaps of `self`; `self` wins where both know a value."""
        values = {}
        for name in self.__dataclass_fields__:
            if name in ("sources", "flags"):
                continue
            mine = getattr(self, name)
            values[name] = mine if mine is not None else getattr(other, name)
        return ReportedCapacity(**values, flags={**other.flags, **self.flags},
                                sources={**other.sources, **self.sources})


@dataclass(frozen=True)
class Flag:
    """One engine command-line flag, by its real name (without `--`).

    The emulator builds its argparse from these and `launch_command` renders them, so the name,
    type and default of a flag are written once, in the dialect module.
    """

    name: str
    type: type | None  # int / float / str; None for a boolean switch
    default: object = None
    help: str = ""
    negatable: bool = False  # boolean with a real `--no-NAME` form (argparse BooleanOptionalAction)
    emulated: bool = True  # the emulator accepts it (False: real-engine-only, dropped for the emulator)
    kind: str = ""  # how an expectation's value is validated: int, count ("2k"), len (count or auto),
    #                 bytes ("10G"), frac (0 < x <= 1), float, bool, str; "" derives it from `type`
    lo: float | None = None  # the smallest value the engine accepts
    # The `kvprobe.theory.ledger.build.LedgerInputs` field this flag sets, when the ledger reads it: the one
    # mapping used by expectations (spec/flags.py `flag_ledger_kwargs`) and `kvprobe ledger`'s options.
    ledger: str | None = None
    # The first release with this flag (its theory's release rule); None: every release kvprobe knows. An
    # engine that does not publish a flag its release lacks assumes nothing about it.
    since: tuple[int, ...] | None = None

    def in_release(self, version: str | None) -> bool:
        return self.since is None or version is None or version_tuple(version) >= self.since

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def value_kind(self) -> str:
        return self.kind or {int: "int", float: "float", str: "str", None: "bool"}.get(self.type, "str")


def render_flags(flags: dict[str, object], known: dict[str, Flag]) -> list[str]:
    """Real CLI arguments for `flags` ({name without --: value}): True → `--x`, False → `--no-x` where
    the engine has that form (else omitted), None → omitted, anything else → `--x value`."""
    argv: list[str] = []
    for name, value in flags.items():
        flag = known.get(name)
        if value is None:
            continue
        if value is True:
            argv.append(f"--{name}")
        elif value is False:
            if flag is not None and flag.negatable:
                argv.append(f"--no-{name}")
        else:
            argv += [f"--{name}", str(value)]
    return argv


def _no_length_limit(reported: ReportedCapacity) -> tuple[int, int] | None:
    return None


def _nothing_reported(*_args) -> ReportedCapacity:
    return ReportedCapacity()


def _no_refusal(log_text: str) -> str | None:
    return None


class OptionalFacts:
    """Every fact a dialect module *may* leave out, with the value that holds when it does.

    `kvprobe.engines.get_dialect` gives a dialect module each of these it does not define itself,
    so callers read `dialect.RUNNING_GAUGE_EXACT` and never `getattr(dialect, ..., default)`. A
    reader sees here every optional fact a dialect can have; the required ones (METRICS, FLAGS,
    COMPLETIONS_PATH, completion_body, launch_command, ...) are what every dialect module defines.
    """

    # /health answers 200 once the engine serves (both engines today).
    HEALTH_PATH: str = "/health"
    # What an attached engine's liveness is polled on during a probe (every 0.2 s, 2 s per answer),
    # so it must be cheap under load; None: HEALTH_PATH.
    ALIVE_PATH: str | None = None
    # JSON endpoints read by `reported_from_info` when facts are gathered.
    INFO_PATHS: tuple[str, ...] = ()
    # Endpoints only some deployments serve (vLLM's dev-mode /server_info): a 404 there is no error.
    OPTIONAL_INFO_PATHS: tuple[str, ...] = ()
    # Versions whose facts (policy, log formats, defaults, error bodies) this module holds; another
    # version is refused unless the user names the admission policy (`policy:` / `--policy`).
    KNOWN_VERSIONS: tuple[str, ...] = ()
    # The running gauge is a count after every step (True), or a sample taken at scheduler events
    # (False): then the probe measures running from the client's streams and reconciles the two.
    RUNNING_GAUGE_EXACT: bool = True
    # Engine steps between admission and the first streamed token (the client cannot see admission).
    FIRST_TOKEN_LEAD_STEPS: float = 1
    # When idle, the scheduler's gauges are republished only this often (seconds), so after the load
    # stops they may hold the last busy reading that long; None: they are written after every step.
    IDLE_REPORT_SECONDS: float | None = None
    # The preemption/retraction counter appears only at the first event (a labelled counter whose
    # child is created then): absent from a good scrape before that means "none yet".
    PREEMPTION_COUNTER_LAZY: bool = False
    # The flags of the limits a diagnosis names (without --), or None when the engine has none;
    # the theory's scheduler config has a field of the same name with '_' for '-'.
    REQUEST_CAP_FLAG: str | None = None  # the cap on requests running at once
    TOKEN_BUDGET_FLAG: str | None = None  # the per-step token budget
    # The flag that streams every N tokens instead of every token (the first at once), or None: a replay
    # paces its steps so that the client still reads every stream (kvprobe.probe.repro.shadow_step_ms).
    STREAM_INTERVAL_FLAG: str | None = None
    # (max length, HTTP status of a fixed-length request one token past it), or None when unknown.
    length_limit = staticmethod(_no_length_limit)
    # What the engine says about itself: start-up log text, /metrics families, an info endpoint.
    parse_startup_log = staticmethod(_nothing_reported)
    reported_from_metrics = staticmethod(_nothing_reported)
    reported_from_info = staticmethod(_nothing_reported)
    # The line of a start-up log that says why the engine refused to start (an unknown flag, a pool
    # too small for max_model_len), or None: it heads the launcher's one-line error.
    startup_refusal_line = staticmethod(_no_refusal)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(n for n in vars(cls) if not n.startswith("_") and n != "names" and n != "apply")

    @classmethod
    def apply(cls, module: ModuleType) -> ModuleType:
        """Give `module` the default of every optional fact it does not define; returns it."""
        for name in cls.names():
            if not hasattr(module, name):
                setattr(module, name, getattr(cls, name))
        return module
