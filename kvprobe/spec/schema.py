"""Validation primitives for `kvprobe.spec.expectation`: a YAML value that knows its file and key path.

Every check raises `spec_error(file, "key.path[2].sub", expected, got)`, so each mistake in an
expectation or a profile is reported as one line naming the file, the key and what was wanted.
The engine-flag tables at the bottom say which of an engine's own flags kvprobe reads (for the
ledger) and what type each takes; any other flag is passed to the engine untouched.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvprobe.errors import ConfigError, spec_error

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,79}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MISSING = object()


class Shown(str):
    """A description printed as is in `got` (spec_error shows `got!r`; this avoids quotes)."""

    def __repr__(self) -> str:
        return str(self)


def show(value: object) -> object:
    """A short, single-line rendering of a YAML value for an error message."""
    if isinstance(value, dict):
        return Shown(f"a mapping with keys {', '.join(map(str, list(value)[:6]))}" if value else "an empty mapping")
    if isinstance(value, list):
        return Shown(f"a list of {len(value)}")
    if value is None:
        return Shown("nothing (null)")
    if isinstance(value, str) and len(value) > 60:
        return value[:57] + "..."
    return value


def did_you_mean(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Node:
    """A value read from YAML, with the file it came from and its key path inside that file."""

    __slots__ = ("value", "file", "path")

    def __init__(self, value: object, file: str, path: str = ""):
        self.value = value
        self.file = file
        self.path = path

    def child(self, key: str | int) -> Node:
        if isinstance(key, int):
            path = f"{self.path}[{key}]"
            value = self.value[key]  # type: ignore[index]
        else:
            path = f"{self.path}.{key}" if self.path else key
            value = self.value.get(key) if isinstance(self.value, dict) else None
        return Node(value, self.file, path)

    def error(self, expected: str, got: object = _MISSING) -> ConfigError:
        shown = show(self.value) if got is _MISSING else got
        return spec_error(self.file, self.path or "(top level)", expected, shown)

    # -- containers -------------------------------------------------------------------------

    def mapping(self, allowed: Iterable[str], *, required: Iterable[str] = (), what: str = "") -> dict[str, Node]:
        """Check a mapping with string keys, no unknown key, every required key present."""
        allowed = list(allowed)
        if not isinstance(self.value, dict):
            raise self.error(what or f"a mapping with keys {', '.join(allowed)}")
        for key in self.value:
            if not isinstance(key, str):
                raise spec_error(self.file, f"{self.path}[{key!r}]" if self.path else repr(key),
                                 "a text key", Shown(type(key).__name__))
            if key not in allowed:
                raise self.child(key).error(
                    f"a known key{' of ' + self.path if self.path else ''}: {', '.join(allowed)}"
                    f"{did_you_mean(key, allowed)}", Shown(f"unknown key {key!r}"))
        for key in required:
            if key not in self.value:
                raise self.child(key).error("this key to be present", Shown("nothing (missing)"))
        return {key: self.child(key) for key in self.value}

    def seq(self, *, nonempty: bool = False, what: str = "a list") -> list[Node]:
        if not isinstance(self.value, list):
            raise self.error(what)
        if nonempty and not self.value:
            raise self.error(f"{what}, not empty", Shown("an empty list"))
        return [self.child(i) for i in range(len(self.value))]

    # -- scalars ----------------------------------------------------------------------------

    def integer(self, *, lo: int | None = None, hi: int | None = None, what: str = "an integer") -> int:
        v = self.value
        if isinstance(v, float) and v.is_integer() and not isinstance(v, bool):
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(_bounded(what, lo, hi))
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self.error(_bounded(what, lo, hi))
        return v

    def number(self, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
               hi_open: bool = False, what: str = "a number") -> float:
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise self.error(_bounded(what, lo, hi, lo_open, hi_open))
        too_low = lo is not None and (v <= lo if lo_open else v < lo)
        too_high = hi is not None and (v >= hi if hi_open else v > hi)
        if too_low or too_high:
            raise self.error(_bounded(what, lo, hi, lo_open, hi_open))
        return float(v)

    def string(self, *, pattern: re.Pattern | None = None, what: str = "a text value") -> str:
        v = self.value
        if not isinstance(v, str) or not v.strip():
            raise self.error(what)
        if pattern is not None and not pattern.match(v):
            raise self.error(what)
        return v

    def boolean(self, *, what: str = "true or false") -> bool:
        if not isinstance(self.value, bool):
            raise self.error(what)
        return self.value

    def choice(self, options: Iterable[str], *, what: str = "") -> str:
        options = list(options)
        v = self.value
        if not isinstance(v, str) or v not in options:
            hint = did_you_mean(v, options) if isinstance(v, str) else ""
            raise self.error(f"{what or 'one of'} {', '.join(options)}{hint}")
        return v


def _bounded(what: str, lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    def fmt(x):
        return f"{x:g}" if isinstance(x, float) else str(x)

    if lo is not None and hi is not None:
        return f"{what} in {'(' if lo_open else '['}{fmt(lo)}, {fmt(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{what} {'>' if lo_open else '>='} {fmt(lo)}"
    if hi is not None:
        return f"{what} {'<' if hi_open else '<='} {fmt(hi)}"
    return what


# -- the schema: what a loaded profile and expectation hold ------------------------------

CHECKS = ("rejection_point", "reported_capacity", "no_preemption", "leak", "usage_gap", "length_limit", "exactness")
FLEET_CHECKS = ("replica_leak", "replica_usage", "router_imbalance")  # a fleet target only (kvprobe/verdict/fleet.py)
ENGINES = ("vllm", "sglang")
RAMP_STRATEGIES = ("explicit", "around-prediction", "bisect")
# Fault names of `kvprobe emulate --fault NAME` (kvprobe/emulator); each makes one check fail.

def _emulator_faults() -> tuple[str, ...]:
    from kvprobe.targets.emulator.faults import FAULTS  # the emulator owns its fault names

    return tuple(FAULTS)


EMULATOR_FAULTS = _emulator_faults()
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
    strategy: str  # "explicit" | "around-prediction" | "bisect"
    levels: tuple[int, ...] = ()
    below: int = 4
    window: int = 2
    above: int = 2
    max_users: int | None = None
    confirm: int = 1


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
    fleet: dict = field(default_factory=dict)  # `fleet:` replicas, router, policy (+ replica_urls attached); {}: one engine


@dataclass(frozen=True)
class Hardware:
    gpu_memory_bytes: int | None = None
    gpu_count: int = 1
    name: str | None = None


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


# -- YAML -------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (PyYAML keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[object, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain value", key_node.start_mark) from None
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {first + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def read_yaml(path: str | Path) -> object:
    """Parse one YAML file; every failure is a one-line ConfigError naming the file."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise spec_error(file, "(file)", "an existing YAML file", Shown("no such file")) from None
    except IsADirectoryError:
        raise spec_error(file, "(file)", "a YAML file", Shown("a directory")) from None
    except UnicodeDecodeError as err:
        raise spec_error(file, "(file)", "UTF-8 text", Shown(f"undecodable byte at offset {err.start}")) from None
    except OSError as err:
        raise spec_error(file, "(file)", "a readable YAML file", Shown(one_line(err.strerror or err))) from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(yaml)"
        problem = one_line(err.problem or err.context or "a syntax error")
        cm = err.context_mark
        if err.context and err.problem and cm is not None:  # where the unfinished construct began
            problem += f" ({one_line(err.context)} at line {cm.line + 1}, column {cm.column + 1})"
        raise spec_error(file, where, "valid YAML", Shown(problem)) from None
    except yaml.YAMLError as err:
        raise spec_error(file, "(yaml)", "valid YAML", Shown(one_line(err))) from None


# -- engine flags -----------------------------------------------------------------------------
# The flags themselves (names, kinds, smallest values, aliases, the real flags kvprobe does not
# model) are engine facts: they live in kvprobe/engines/<engine>.py and are read from there.


def _flag_table(engine: str) -> tuple[dict[str, tuple[str, float | None]], tuple[str, ...], dict[str, str]]:
    from kvprobe.engines import get_dialect

    d = get_dialect(engine)
    known = {name: (f.value_kind, f.lo) for name, f in d.FLAGS.items() if name != "served-model-name"}
    return known, tuple(d.OTHER_FLAGS), dict(d.FLAG_ALIASES)


# Flags the launcher owns; writing them in `flags:` would fight it.
MANAGED_FLAGS = {
    "host": "the launcher binds 127.0.0.1; set target.port for a fixed port",
    "port": "set target.port instead",
    "model": "use the top-level `model` key",
    "model-path": "use the top-level `model` key",
    "served-model-name": "use the top-level `served_model_name` key",
    "api-key": "secrets never live in YAML; use target.api_key_env",
}

FLAG_TABLES = {engine: _flag_table(engine) for engine in ("vllm", "sglang")}


def parse_units(node: Node, kind: str) -> int:
    """Human units through kvprobe.units when present (vLLM: 1k=1000, 1K=1024; 10G=10*2**30)."""
    v = node.value
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if not isinstance(v, str):
        raise node.error("an integer or a size with units like '2k' / '24GiB'" if kind == "bytes"
                         else "an integer or a count like '2k'")
    try:
        from kvprobe import units
    except ImportError:  # units.py not written yet: plain integers only
        if v.strip().isdigit():
            return int(v)
        raise node.error("an integer (kvprobe.units is not available to read units)") from None
    try:
        return units.parse_bytes(v, key=node.path) if kind == "bytes" else units.parse_count(v, key=node.path)
    except (ConfigError, ValueError):
        raise node.error("a size like '24GiB', '80GB' or '10G'" if kind == "bytes"
                         else "a count like 2048, '2k' (1000) or '2K' (1024)") from None


def parse_flag(node: Node, kind: str, lo: int | None) -> object:
    """Validate and normalise one known flag value (counts and sizes become ints)."""
    if kind == "bool":
        return node.boolean(what="true or false (false writes --no-<flag> where the engine has it)")
    if kind == "str":
        return node.string(what="a text value")
    if kind == "frac":
        return node.number(lo=0, hi=1, lo_open=True, what="a fraction")
    if kind == "float":
        return node.number(lo=lo, what="a number")
    if kind == "int":
        return node.integer(lo=lo, what="an integer")
    if kind == "len" and (node.value == "auto" or node.value == -1):
        return node.value
    value = parse_units(node, "bytes" if kind == "bytes" else "count")
    if lo is not None and value < lo:
        raise node.error(f"a value >= {lo}")
    return value


def _plain_flag_value(node: Node) -> object:
    """A flag kvprobe does not model: any scalar, or a list of scalars (a repeated/multi-value flag)."""
    scalars = (str, int, float, bool)
    v = node.value
    if isinstance(v, scalars) or (isinstance(v, list) and v and all(isinstance(x, scalars) for x in v)):
        return v
    raise node.error("a value (a number, text, true for a bare flag, or a list)")


def parse_flags(node: Node, engine: str, *, strict: bool = False) -> dict[str, object]:
    """The engine's own flags, by their real names without `--`; known ones are typed and normalised
    (counts and sizes to ints, aliases to one spelling). A flag kvprobe does not know is an error
    with the closest known name when `strict` (the emulator, a shadow or an attached engine: nothing
    would read it, so it could only mislead); otherwise (a launched real engine) it is passed
    through as written and the engine judges it."""
    table, others, aliases = FLAG_TABLES[engine]
    foreign = {f: e for e, (t, _, _) in FLAG_TABLES.items() if e != engine for f in t
               if f not in table and f not in others and f not in aliases}
    if not isinstance(node.value, dict):
        raise node.error("a mapping of the engine's flags, e.g. {max-model-len: 2048}")
    out: dict[str, object] = {}
    for key in node.value:
        child = node.child(key)
        if not isinstance(key, str):
            raise child.error("a flag name", Shown(repr(key)))
        if key.startswith("-"):
            raise child.error(f"the flag name without '--' ({key.lstrip('-')!r})", Shown(repr(key)))
        if "_" in key:
            raise child.error(f"the command-line spelling with '-' ({key.replace('_', '-')!r})", Shown(repr(key)))
        if key in MANAGED_FLAGS:
            raise child.error(f"no {key!r} flag here: {MANAGED_FLAGS[key]}", Shown(repr(key)))
        name = aliases.get(key, key)
        if name in out:
            raise child.error(f"one spelling of the flag {name!r}", Shown("both spellings"))
        if name in table:
            out[name] = parse_flag(child, *table[name])
            continue
        if key in foreign:
            raise child.error(f"a {engine} flag ({key!r} is a {foreign[key]} flag)", Shown(repr(key)))
        if key not in others:
            close = difflib.get_close_matches(key, [*table, *others], n=1, cutoff=0.6 if strict else 0.85)
            if close:
                raise child.error(f"a {engine} flag (did you mean {close[0]!r}?)", Shown(repr(key)))
            if strict:
                raise child.error(f"a {engine} flag kvprobe knows (`kvprobe ledger --help` lists them; only "
                                  "`launch: engine` passes other flags to the engine)", Shown(repr(key)))
        out[name] = _plain_flag_value(child)
    return out


def length_limits(engine: str, flags: dict) -> list[tuple[str, int, str]]:
    """(flag, largest P+O, why) for each length rule the flags make known.

    vLLM 0.33.0: P + max_tokens > max_model_len is clamped, and with min_tokens = O that is a 400
    (shared/reference/vllm.md, summary 13). SGLang 0.5.23: max_new_tokens is clipped silently to
    min(context_len, M) - P - 2, so exactly O tokens need P + O <= context_len - 2 and <= M - 2
    (scheduler.py::init_req_max_new_tokens; shared/reference/sglang.md §1.5).
    """
    rules = []
    if engine == "vllm":
        mml = flags.get("max-model-len")
        if isinstance(mml, int) and mml > 0:
            rules.append(("max-model-len", mml, "vLLM answers 400 when min_tokens no longer fits"))
    elif engine == "sglang":
        if isinstance(flags.get("context-length"), int):
            rules.append(("context-length", flags["context-length"] - 2,
                          "SGLang clips output to context_len - P - 2"))
        if isinstance(flags.get("max-total-tokens"), int):
            rules.append(("max-total-tokens", flags["max-total-tokens"] - 2,
                          "SGLang clips output to max_total_tokens - P - 2"))
    return rules


def parallel_sizes(engine: str, flags: dict) -> tuple[int, int, int]:
    if engine == "vllm":
        names = ("tensor-parallel-size", "pipeline-parallel-size", "data-parallel-size")
    else:
        names = ("tp-size", "pp-size", "dp-size")
    return tuple(int(flags.get(n, 1)) for n in names)  # type: ignore[return-value]


def flag_ledger_kwargs(engine: str, flags: dict, version: str | None = None) -> dict:
    """The ledger's engine configuration from the engine's flags: each flag whose dialect entry names a
    `LedgerInputs` field (`Flag.ledger`) sets it. The one mapping of flags to the ledger, used by an
    expectation and by `kvprobe ledger`'s generated options alike."""
    from kvprobe.engines import get_dialect

    kw: dict = {}
    for name, flag in get_dialect(engine).FLAGS.items():
        value = flags.get(name)
        if flag.ledger is None or value is None:
            continue
        if name == "max-model-len" and value in ("auto", -1):
            value = -1  # vLLM's auto-fit to the pool
        kw[flag.ledger] = value
    if engine == "vllm" and "async_scheduling" not in kw:
        from kvprobe.engines import vllm

        # not given: the engine's own default for the version (on a GPU; engines/vllm.py)
        kw["async_scheduling"] = vllm.async_scheduling_default(version or vllm.DEFAULT_VERSION)
    return kw


def ledger_kwargs(exp: Expectation, *, users: int | None = None) -> dict:
    """Keyword arguments of `kvprobe.theory.ledger.build.LedgerInputs` for one expectation."""
    kw: dict = dict(
        engine=exp.engine, model=exp.model_config or exp.model, engine_version=exp.version,
        gpu_memory_bytes=exp.hardware.gpu_memory_bytes,
        prompt_tokens=exp.profile.request.prompt_tokens, output_tokens=exp.profile.request.output_tokens,
        users=users, estimates=dict(exp.estimates), base_dir=exp.model_base_dir, policy=exp.policy,
        shared_prefix_tokens=exp.profile.request.shared_prefix_tokens,
    )
    kw.update(flag_ledger_kwargs(exp.engine, exp.flags, exp.version))
    return kw
