"""An expectation's engine flags: which of an engine's own flags kvprobe reads (for the ledger) and
what type each takes; any other flag is passed to the engine untouched. The flags themselves
(names, kinds, smallest values, aliases, the real flags kvprobe does not model) are engine facts:
they live in kvprobe/engines/<engine>.py and are read from there.
"""

from __future__ import annotations

import difflib

from kvprobe import units
from kvprobe.engines import get_dialect, vllm
from kvprobe.errors import ConfigError
from kvprobe.releases import ENGINES
from kvprobe.spec.gpus import arch_of, sms_of
from kvprobe.spec.node import Node, Shown
from kvprobe.spec.schema import Expectation


def _flag_table(engine: str) -> tuple[dict[str, tuple[str, float | None]], tuple[str, ...], dict[str, str]]:
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

FLAG_TABLES = {engine: _flag_table(engine) for engine in ENGINES}


def parse_units(node: Node, kind: str) -> int:
    """Human units through kvprobe.units (vLLM: 1k=1000, 1K=1024; 10G=10*2**30)."""
    v = node.value
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if not isinstance(v, str):
        raise node.error("an integer or a size with units like '2k' / '24GiB'" if kind == "bytes"
                         else "an integer or a count like '2k'")
    try:
        return units.parse_bytes(v, key=node.path) if kind == "bytes" else units.parse_count(v, key=node.path)
    except (ConfigError, ValueError):
        raise node.error("a size like '24GiB', '80GB' or '10G'" if kind == "bytes"
                         else "a count like 2048, '2k' (2000) or '2K' (2048)") from None


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

    vLLM 0.33.0: P + max_tokens > max_model_len is clamped (entrypoints/serve/utils/api_utils.py
    `get_max_tokens`), and with min_tokens = O that is a 400 (sampling_params.py: min_tokens must be
    <= max_tokens). SGLang 0.5.23: max_new_tokens is clipped silently to min(context_len, M) - P - 2,
    so exactly O tokens need P + O <= context_len - 2 and <= M - 2
    (managers/scheduler.py `init_req_max_new_tokens`).
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
    kw: dict = {}
    for name, flag in get_dialect(engine).FLAGS.items():
        value = flags.get(name)
        if flag.ledger is None or value is None:
            continue
        if name == "max-model-len" and value in ("auto", -1):
            value = -1  # vLLM's auto-fit to the pool
        kw[flag.ledger] = value
    if engine == "vllm" and "async_scheduling" not in kw:
        # not given: the engine's own default for the version (on a GPU; engines/vllm.py)
        kw["async_scheduling"] = vllm.async_scheduling_default(version or vllm.DEFAULT_VERSION)
    return kw


def ledger_kwargs(exp: Expectation, *, users: int | None = None) -> dict:
    """Keyword arguments of `kvprobe.theory.ledger.build.LedgerInputs` for one expectation."""
    kw: dict = dict(
        engine=exp.engine, model=exp.model_config or exp.model, engine_version=exp.version,
        gpu_memory_bytes=exp.hardware.gpu_memory_bytes, gpu_free_memory_bytes=exp.hardware.gpu_free_memory_bytes,
        prompt_tokens=exp.profile.request.prompt_tokens, output_tokens=exp.profile.request.output_tokens,
        users=users, estimates=dict(exp.estimates), base_dir=exp.model_base_dir, policy=exp.policy,
        shared_prefix_tokens=exp.profile.request.shared_prefix_tokens, gpu_arch=arch_of(exp.hardware.name),
        gpu_sms=sms_of(exp.hardware.name), gpu_capability=exp.hardware.capability,
    )
    kw.update(flag_ledger_kwargs(exp.engine, exp.flags, exp.version))
    return kw
