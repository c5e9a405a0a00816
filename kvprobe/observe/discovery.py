"""What a running engine says about its own configuration, against what the expectation assumed.

An attached engine was started by someone else, with flags nobody wrote down. Before the ramp, the
probe reads what the engine publishes (the dialect modules parse it into `EngineFacts.reported`:
vLLM's /v1/models, /version, `vllm:cache_config_info` and, in dev mode, /server_info; SGLang's
/server_info and /v1/models) and builds the ledger's engine configuration from it. The
expectation's flags fill only what the engine does not publish, and each of those is named as an
assumption. A flag of the expectation that the engine contradicts is reported with both values.

`discover(exp, facts)` -> `Discovery`; `Discovery.expectation(exp)` is the expectation the ledger
and the load should use (the engine's flags, version and served name).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvprobe.engines import get_dialect, is_known_version, normalize_version, unknown_version_message
from kvprobe.errors import ConfigError

# An expectation's value that matches whatever the engine resolved it to.
_RESOLVED_BY_ENGINE = {"max-model-len": ("auto", -1), "dtype": ("auto",)}
# The flag that sizes the pool from the engine's own report when nothing else can (no GPU memory
# declared, no pool flag): (flag, ReportedCapacity field, where the engine says it).
_POOL_FROM_REPORT = {"vllm": ("num-gpu-blocks-override", "num_blocks", "num_gpu_blocks"),
                     "sglang": ("max-total-tokens", "kv_tokens", "max_total_num_tokens")}
_POOL_FLAGS = {"vllm": ("num-gpu-blocks-override", "kv-cache-memory-bytes"), "sglang": ("max-total-tokens",)}
# Capacity figures of a built ledger that show the value an unpublished limit took by default.
# Expectation.path of the expectation `kvprobe probe --url` builds: its flags were declared on the
# command line, and the probe says so (kvprobe.spec.attach).
COMMAND_LINE = "kvprobe probe --url"
_LEDGER_VALUE = {"max_num_seqs": "max_running", "max_running_requests": "max_running",
                 "max_num_batched_tokens": "token_budget", "chunked_prefill_size": "token_budget"}


def _shown(value: object) -> str:
    return "not given (the engine's default)" if value is None else str(value)


def same_value(expected: object, published: object, flag: str = "") -> bool:
    """Does the engine's published value agree with the expectation's (numbers within 1e-6)?"""
    if expected in _RESOLVED_BY_ENGINE.get(flag, ()):
        return True
    if isinstance(expected, bool) or isinstance(published, bool):
        return expected is published or (expected == published and type(expected) is type(published))
    if isinstance(expected, int | float) and isinstance(published, int | float):
        return abs(expected - published) <= 1e-6 * max(abs(expected), abs(published), 1.0)
    return expected == published


@dataclass(frozen=True)
class Contradiction:
    """A value the expectation states and the engine publishes differently."""

    key: str  # a flag's real name, "version" or "served model name"
    expected: object
    published: object  # None: the engine says the flag was not given
    source: str
    said_by: str = "the expectation"  # or "the command line"

    def line(self) -> str:
        wins = "; the engine's value is used" if self.said_by == "the command line" else ""
        return (f"{self.key}: {self.said_by} says {self.expected}, the engine publishes "
                f"{_shown(self.published)} ({self.source}){wins}")


@dataclass(frozen=True)
class Assumed:
    """A flag the ledger reads that the engine does not publish."""

    flag: str
    value: object  # None: the engine's default
    origin: str  # "expectation" (the file or the command line) | "default"


@dataclass
class Discovery:
    engine: str
    version: str | None  # as published
    served_model_name: str | None
    model_path: str | None
    flags: dict[str, object]  # the ledger's engine configuration
    published: dict[str, tuple[object, str]] = field(default_factory=dict)  # flag -> (value, source)
    assumed: list[Assumed] = field(default_factory=list)
    contradictions: list[Contradiction] = field(default_factory=list)
    pool_from_engine: str | None = None  # set when the pool is the engine's own report
    declared_by: str = "the expectation"  # or "the command line" (kvprobe probe --url)

    def expectation(self, exp):
        """`exp` with the engine's flags, version and served name: what the ledger and load use."""
        version = normalize_version(self.version) if self.version else exp.version
        served = self.served_model_name or exp.served_model_name
        return dataclasses.replace(exp, flags=dict(self.flags), version=version, served_model_name=served)

    def lines(self, ledger=None) -> list[str]:
        """What the probe says before the ramp: what was read, what was assumed, what disagrees."""
        out = []
        if self.published:
            shown = ", ".join(f"{k} {'unset' if v is None else v}" for k, (v, _) in sorted(self.published.items()))
            out.append(f"published by the engine: {shown}")
        if self.pool_from_engine:
            out.append(f"pool: {self.pool_from_engine}")
        given = [f"{a.flag} {a.value}" for a in self.assumed if a.origin == "expectation"]
        defaults = [f"{a.flag}{self._default_value(a, ledger)}" for a in self.assumed if a.origin == "default"]
        if given or defaults:
            parts = ([f"from {self.declared_by}: {', '.join(given)}"] if given else []) + \
                ([f"the engine's defaults: {', '.join(defaults)}"] if defaults else [])
            out.append(f"assumed (the engine does not publish them): {'; '.join(parts)}")
        out += [f"CONTRADICTION {c.line()}" for c in self.contradictions]
        return out

    def _default_value(self, a: Assumed, ledger) -> str:
        flag = get_dialect(self.engine).FLAGS[a.flag]
        attr = _LEDGER_VALUE.get(flag.ledger or "")
        return f" {getattr(ledger.capacity, attr)}" if ledger is not None and attr is not None else ""

    def to_dict(self) -> dict:
        return {"engine": self.engine, "version": self.version, "served_model_name": self.served_model_name,
                "model_path": self.model_path, "flags": self.flags,
                "published": {k: {"value": v, "source": s} for k, (v, s) in self.published.items()},
                "assumed": [dataclasses.asdict(a) for a in self.assumed],
                "contradictions": [dataclasses.asdict(c) for c in self.contradictions],
                "pool_from_engine": self.pool_from_engine, "declared_by": self.declared_by}


def discover(exp, facts) -> Discovery:
    """Compare what the engine publishes (`facts.reported`) with the expectation `exp`."""
    engine = exp.engine
    rep = facts.reported
    dialect = get_dialect(engine)
    said_by = "the command line" if exp.path == COMMAND_LINE else "the expectation"
    flags = dict(exp.flags)
    published: dict[str, tuple[object, str]] = {}
    contradictions: list[Contradiction] = []
    for name, value in rep.flags.items():
        source = rep.sources.get(f"flags.{name}", "published")
        published[name] = (value, source)
        if name in exp.flags and not same_value(exp.flags[name], value, name):
            contradictions.append(Contradiction(name, exp.flags[name], value, source, said_by))
        if value is None:
            flags.pop(name, None)  # not given: the engine runs its default, so does the ledger
        else:
            flags[name] = value
    contradictions += _identity_contradictions(exp, rep)
    assumed = [Assumed(name, exp.flags.get(name), "expectation" if name in exp.flags else "default")
               for name, flag in dialect.FLAGS.items()
               if flag.ledger and name not in published and flag.in_release(rep.version or exp.version)]
    disc = Discovery(engine, rep.version, rep.served_model_name, rep.model_path, flags, published, assumed,
                     contradictions, declared_by=said_by)
    _pool_from_report(disc, exp, rep)
    _check_version(disc, exp, facts)
    return disc


def _identity_contradictions(exp, rep) -> list[Contradiction]:
    out = []
    if rep.version and normalize_version(rep.version) != normalize_version(exp.version):
        out.append(Contradiction("version", exp.version, rep.version, rep.sources.get("version", "published")))
    asked = exp.served_model_name or exp.model
    if rep.served_model_name and rep.served_model_name != asked:
        out.append(Contradiction("served model name", asked, rep.served_model_name,
                                 rep.sources.get("served_model_name", "published")))
    return out


def _pool_from_report(disc: Discovery, exp, rep) -> None:
    """Without a declared GPU or a pool flag the ledger cannot size the pool: take the engine's."""
    if exp.hardware.gpu_memory_bytes is not None or any(disc.flags.get(f) is not None
                                                        for f in _POOL_FLAGS[disc.engine]):
        return
    flag, attr, said = _POOL_FROM_REPORT[disc.engine]
    value = getattr(rep, attr)
    if value is None:
        return  # the ledger will say what it needs
    disc.flags[flag] = int(value)
    disc.pool_from_engine = (f"{int(value)} ({said} as the engine reports it, {rep.sources.get(attr, 'published')}; "
                             "no GPU memory declared, so the ledger takes the engine's pool)")


def reported_pool(engine: str, rep) -> tuple[str, int, tuple[str, ...]] | None:
    """The pool the engine reports as the flag that fixes it: (flag, value, the engine's other pool
    flags, which that one replaces), or None when the engine does not report it."""
    flag, attr, _ = _POOL_FROM_REPORT[engine]
    value = getattr(rep, attr)
    return None if value is None else (flag, int(value), tuple(f for f in _POOL_FLAGS[engine] if f != flag))


def _check_version(disc: Discovery, exp, facts) -> None:
    """A published version kvprobe has no facts for is refused unless the policy was chosen."""
    if disc.version and exp.policy is None and not is_known_version(disc.engine, disc.version):
        raise ConfigError(f"the engine at {facts.url} reports {disc.engine} {disc.version}: expected "
                          + unknown_version_message(disc.engine, disc.version), key="version")


def _json(url: str, path: str, headers: dict[str, str]) -> object:
    import json

    from kvprobe.observe.http import http_get

    try:
        status, body = http_get(url + path, headers=headers, timeout=5.0)
        return json.loads(body) if status == 200 else None
    except (OSError, ValueError):
        return None


def engine_signs(url: str, headers: dict[str, str] | None = None) -> dict[str, list[str]]:
    """What the server at `url` says about which engine it is: engine -> the signs, each one line.

    The signs are the engines' own: the metric families' prefix (`vllm:` / `sglang:`, from each
    dialect's metric names), SGLang's /server_info (/get_server_info) and vLLM's dev-mode
    /server_info (its `vllm_config`), vLLM's /version, and /v1/models' `owned_by`."""
    from kvprobe.observe.http import http_get
    from kvprobe.releases import ENGINES

    url, headers = url.rstrip("/"), headers or {}
    dialects = {name: get_dialect(name) for name in ENGINES}
    signs: dict[str, list[str]] = {name: [] for name in ENGINES}
    try:
        status, body = http_get(url + "/metrics", headers=headers, timeout=5.0)
        text = body.decode("utf-8", "replace") if status == 200 else ""
    except OSError:
        text = ""
    for name, d in dialects.items():
        prefix = d.METRICS.running.split(":", 1)[0] + ":"
        if any(line.startswith(prefix) for line in text.splitlines()):
            signs[name].append(f"/metrics has {prefix} families")
    models = _json(url, dialects["vllm"].MODELS_PATH, headers)
    owners = {m.get("owned_by") for m in models.get("data") or [] if isinstance(m, dict)} \
        if isinstance(models, dict) else set()
    for name in ENGINES:
        if name in owners:
            signs[name].append(f"/v1/models says owned_by {name!r}")
    for path in dialects["sglang"].SERVER_INFO_PATHS:
        info = _json(url, path, headers)
        if isinstance(info, dict) and "vllm_config" in info:
            signs["vllm"].append(f"{path} has vllm_config")
            break
        if isinstance(info, dict) and info:
            signs["sglang"].append(f"{path} answers (SGLang's server info)")
            break
    version = _json(url, dialects["vllm"].VERSION_PATH, headers)
    if isinstance(version, dict) and "version" in version and not signs["sglang"]:
        signs["vllm"].append(f"{dialects['vllm'].VERSION_PATH} answers (vLLM's)")
    return signs


def check_engine(url: str, engine: str, headers: dict[str, str] | None = None, *, key: str = "--engine",
                 file: str | None = None) -> None:
    """Stop (bad input) when the server at `url` looks like the other engine than `engine`: which
    one, and the signs. A server with no sign either way, or signs of both, is left to discovery."""
    from kvprobe.observe.http import redact_url

    signs = engine_signs(url, headers)
    seen = [name for name, found in signs.items() if found]
    if engine in seen or len(seen) != 1:
        return
    other = seen[0]
    fix = f"probe it with {key} {other}" if key.startswith("--") else f"write `engine: {other}`"
    raise ConfigError(f"the server at {redact_url(url)} looks like {other}, not {engine} "
                      f"({'; '.join(signs[other])}): {fix}", file=file, key=key)
