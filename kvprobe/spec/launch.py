"""The launch options of an expectation's `target`: what every launched engine needs besides its flags.

* `env` — extra environment variables for the engine's processes (any launch kind);
* `command` (`launch: engine`) — the engine binary and its leading arguments, a list or one string
  split with shell quoting rules; relative paths are resolved against the expectation's folder,
  like `model:` paths, so a file works from any working directory;
* `model` (`launch: engine`) — what the engine loads (a local path or a hub id) when it is not the
  theory's `model:`; the name clients send stays `served_model_name` (or `model:`);
* `time_model` (`launch: shadow`) — the modelled step time of the shadow worker/plugin (the
  emulator's time model, `kvprobe.theory.sim.steptime.TimeModel`);
* `engine_args` (`launch: shadow`) — arguments appended to the engine's command line that kvprobe's
  theory does not read: an engine started with a flag its expectation does not declare, as in a
  staging deployment whose configuration nobody wrote down (the probe must find the effect).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from kvprobe.spec.node import ENV_NAME_RE, Node, Shown
from kvprobe.spec.schema import EMULATOR_FAULTS

LAUNCH_KINDS = ("emulator", "engine", "shadow")
LAUNCH_KEYS = {"emulator": ("emulator",), "engine": ("command", "model"), "shadow": ("time_model", "engine_args")}
# Seconds until /health must answer: the emulator starts in ~1 s, vLLM's shadow in 20-35 s on two
# busy cores (SGLang's in 35-60 s), a real engine loads weights and compiles.
STARTUP_TIMEOUTS = {"emulator": 60.0, "engine": 600.0, "shadow": 300.0}
TIME_MODEL_KEYS = {"step_ms": (0.0, 10_000.0, True), "prefill_us_per_token": (0.0, 1e6, False),
                   "decode_us_per_seq": (0.0, 1e6, False)}
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW", re.IGNORECASE)
_RESERVED = {"shadow": re.compile(r"^(KVPROBE_SHADOW\w*|PYTHONPATH)$")}


def parse_env(node: Node, kind: str = "") -> dict[str, str]:
    """`{NAME: value}`; values are scalars written as text. Names that look like secrets are refused:
    a key never lives in YAML (the launched process inherits kvprobe's own environment)."""
    keys = node.value
    if not isinstance(keys, dict):
        raise node.error("a mapping of environment variables, e.g. {OMP_NUM_THREADS: 1}")
    out: dict[str, str] = {}
    for name in keys:
        child = node.child(name)
        if not isinstance(name, str) or not ENV_NAME_RE.match(name):
            raise child.error("an environment variable name (letters, digits, '_')", Shown(repr(name)))
        if _SECRET_NAME.search(name):
            raise child.error("no secret here: export it in the shell that runs kvprobe (the engine inherits it)",
                              Shown(f"{name} (value not shown)"))
        reserved = _RESERVED.get(kind)
        if reserved is not None and reserved.match(name):
            raise child.error(f"a variable kvprobe does not set itself for launch: {kind}", Shown(repr(name)))
        value = child.value
        if isinstance(value, bool):
            value = "1" if value else "0"
        if not isinstance(value, str | int | float):
            raise child.error("a text or number value")
        out[name] = str(value)
    return out


def parse_engine_args(node: Node) -> tuple[str, ...]:
    """A list of command-line arguments, each a string (`[--no-scheduler-reserve-full-isl]`)."""
    return tuple(n.string(what="a command-line argument, e.g. --no-scheduler-reserve-full-isl") for n in node.seq())


def parse_time_model(node: Node) -> dict[str, float]:
    keys = node.mapping(tuple(TIME_MODEL_KEYS))
    out = {}
    for name, child in keys.items():
        lo, hi, lo_open = TIME_MODEL_KEYS[name]
        out[name] = child.number(lo=lo, hi=hi, lo_open=lo_open,
                                 what="milliseconds per step" if name == "step_ms" else "microseconds")
    return out


def resolve_relative(ref: str, base: Path, *, first: bool = False) -> str:
    """`./x`, `../x` and `~/x` become absolute (relative ones against the expectation's folder); so
    does a relative path that exists there, or, for the binary (`first`), any relative path with a
    '/'. Anything else (a hub id, `python`, a flag) is left as written."""
    if ref.startswith("~"):
        return str(Path(ref).expanduser())
    if ref.startswith(("./", "../")) or (first and "/" in ref and not ref.startswith("/")):
        return str((base / ref).resolve())
    if not ref.startswith(("/", "-")) and "/" in ref and (base / ref).exists():
        return str((base / ref).resolve())
    return ref


def parse_command(node: Node, base: Path) -> tuple[str, ...]:
    raw = node.value
    if isinstance(raw, str) and raw.strip():
        try:
            parts = shlex.split(raw)
        except ValueError as err:  # an unclosed quote
            raise node.error("a command line with balanced quotes", Shown(str(err))) from None
    else:
        parts = [n.string(what="an argument") for n in node.seq(
            nonempty=True, what="the engine command as a list of arguments or one string")]
    return tuple(resolve_relative(p, base, first=i == 0) for i, p in enumerate(parts))


def split_command(text: str, *, key: str = "--engine-command") -> list[str]:
    """A command given on the console or as a pytest option: shell quoting rules, like target.command."""
    from kvprobe.errors import ConfigError

    try:
        parts = shlex.split(text)
    except ValueError as err:
        raise ConfigError(f"expected a command line with balanced quotes, got {text!r} ({err})", key=key) from None
    if not parts:
        raise ConfigError("expected a command, got an empty string", key=key)
    return parts


def check_shadow(exp, node: Node) -> None:
    """`launch: shadow`: an engine environment kvprobe can build for this version, and a way to size
    the pool (a real GPU profiles it; the shadow worker is told a declared GPU or a pool flag)."""
    from kvprobe.errors import ConfigError
    from kvprobe.targets.shadow import recipes

    try:
        recipes.recipe(exp.engine, exp.version)
    except ConfigError as err:
        raise node.child("version").error(f"a version with a shadow engine environment ({err})", exp.version) from None
    if exp.hardware.gpu_free_memory_bytes is not None:  # the shadow sizes from one declared figure
        raise node.child("hardware").child("gpu_free_memory").error(
            "no free memory at start with target launch: shadow (the shadow worker is told one GPU figure and "
            "sizes the pool from it as from an empty card; give the free memory as hardware.gpu_memory there)",
            Shown("a free memory"))
    pool_flags = {"vllm": ("num-gpu-blocks-override", "kv-cache-memory-bytes"), "sglang": ("max-total-tokens",)}
    flags = pool_flags.get(exp.engine, ())
    if exp.hardware.gpu_memory_bytes is None and not any(exp.flags.get(f) is not None for f in flags):
        raise node.child("hardware").child("gpu_memory").error(
            f"a declared GPU (hardware.gpu NAME or hardware.gpu_memory SIZE) with target launch: shadow, or one of "
            f"flags.{', flags.'.join(flags)} "
            "(the shadow target has no GPU to size its pool from)", Shown("nothing (missing)"))


def parse_emulator(node: Node) -> dict:
    """`target.emulator`: the emulator's time model, seed, faults and extra arguments."""
    keys = node.mapping(("step_ms", "prefill_us_per_token", "decode_us_per_seq", "seed", "faults", "args"))
    out: dict = {}
    if "step_ms" in keys:
        out["step_ms"] = keys["step_ms"].number(lo=0, hi=10_000, lo_open=True, what="milliseconds per step")
    for key in ("prefill_us_per_token", "decode_us_per_seq"):
        if key in keys:
            out[key] = keys[key].number(lo=0, hi=1_000_000, what="microseconds")
    if "seed" in keys:
        out["seed"] = keys["seed"].integer(lo=0, what="a seed")
    if "faults" in keys:
        faults = [n.choice(EMULATOR_FAULTS, what="an emulator fault, one of") for n in keys["faults"].seq()]
        out["faults"] = tuple(dict.fromkeys(faults))
    if "args" in keys:
        out["args"] = tuple(n.string(what="a command-line argument") for n in keys["args"].seq())
    return out
