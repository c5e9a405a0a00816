"""The files a user writes: expectations (`expectations/*.yaml`), with their load profiles
(`loadprofiles/*.yaml`, kvprobe.spec.profile) and targets (kvprobe.spec.target).

A profile is a workload: the request shape (P, O, streaming), the ramp, the hold per level, the
sampling interval and the time budget. An expectation is a check: engine, version, model, the
engine's own flags (real names, without `--`), hardware, how to reach the engine, the profile,
tolerances and which checks run. A file written for the emulator reads like one for a real engine;
only `target` differs.

Everything is validated on load; each mistake is one line from `spec_error` naming the file, the
key path and what was expected. Loading a directory reads its `*.yaml` / `*.yml` files only, not
its subfolders: `expectations/faults/` and `expectations/examples/` run only when named.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvprobe.errors import ConfigError, spec_error  # noqa: F401 - re-exported
from kvprobe.releases import ENGINES
from kvprobe.spec.flags import ledger_kwargs, length_limits, parallel_sizes, parse_flags, parse_units
from kvprobe.spec.launch import check_shadow
from kvprobe.spec.node import NAME_RE, Node, Shown, did_you_mean, read_yaml, show
from kvprobe.spec.profile import load_profile, profile_search_dirs, resolve_profile
from kvprobe.spec.schema import (
    CHECKS,
    EMULATOR_FAULTS,
    ESTIMATE_KEYS,
    FLEET_CHECKS,
    RAMP_STRATEGIES,
    Expectation,
    Hardware,
    HoldSpec,
    Profile,
    RampSpec,
    RequestShape,
    StagingRecord,
    Target,
    Tolerances,
)
from kvprobe.spec.target import parse_target
from kvprobe.theory.model.geometry import PRESETS

# -- expectations -----------------------------------------------------------------------------

EXPECTATION_KEYS = ("name", "description", "enabled", "engine", "version", "policy", "model", "model_config",
                    "served_model_name", "flags", "hardware", "target", "profile", "tolerances", "checks",
                    "expect_fail", "estimates", "staging", "versions", "expect_change", "repeat")
REQUIRED_KEYS = ("engine", "version", "model", "target", "profile")


def _parse_tolerances(node: Node) -> Tolerances:
    keys = node.mapping(("reported_capacity", "rejection_point", "rejection_point_relative", "usage_gap"))
    values = {}
    if "reported_capacity" in keys:
        values["reported_capacity"] = keys["reported_capacity"].number(lo=0, hi=1, hi_open=True,
                                                                       what="a relative tolerance")
    if "rejection_point" in keys:
        values["rejection_point"] = keys["rejection_point"].number(lo=0, hi=1e6, what="a tolerance in requests")
    if "rejection_point_relative" in keys:
        values["rejection_point_relative"] = keys["rejection_point_relative"].number(
            lo=0, hi=1, hi_open=True, what="a relative tolerance")
    if "usage_gap" in keys:
        values["usage_gap"] = keys["usage_gap"].number(lo=0, hi=1, what="a gauge tolerance (the gauge is 0..1)")
    return Tolerances(**values)


def tolerance_overrides(items: list[str]) -> dict[str, float]:
    """`NAME=NUMBER` overrides (the --tolerance options of the console and of pytest), checked with the
    same names and ranges as `tolerances:` in a file: an unknown name or 1.5 for a relative tolerance
    is a one-line error, not a TypeError from dataclasses.replace deep in the probe."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"expected NAME=NUMBER, got {item!r}", key="--tolerance") from None
    _parse_tolerances(Node(out, "--tolerance"))
    return out


def _fleet_checks(engine: str) -> tuple[str, ...]:
    """A fleet's default checks: router_imbalance only where the engine's gauges count (not SGLang's samples)."""
    from kvprobe.engines import get_dialect

    exact = get_dialect(engine).RUNNING_GAUGE_EXACT
    return tuple(c for c in FLEET_CHECKS if exact or c != "router_imbalance")


def _parse_checks(node: Node) -> tuple[str, ...]:
    names = [n.choice(CHECKS + FLEET_CHECKS, what="a check, one of")
             for n in node.seq(nonempty=True, what="a list of checks")]
    if len(set(names)) != len(names):
        dup = next(x for x in names if names.count(x) > 1)
        raise node.error("each check once", Shown(f"{dup!r} twice"))
    return tuple(names)


def _parse_estimates(node: Node) -> dict:
    keys = node.mapping(ESTIMATE_KEYS)
    return {k: parse_units(n, "bytes") for k, n in keys.items()}


def _parse_staging(node: Node) -> StagingRecord:
    """`staging:` of a repro.yaml (kvprobe.probe.repro): what the attached probe measured."""
    keys = node.mapping(("rejection_point", "uncertainty", "preemptions", "running", "url", "result"),
                        required=("rejection_point",))

    def number(key: str, what: str) -> float | None:
        child = keys.get(key)
        return None if child is None or child.value is None else child.number(lo=0, what=what)

    running = {}
    for level in keys["running"].seq(what="a list of {users: N, running: MEAN}") if "running" in keys else ():
        pair = level.mapping(("users", "running"), required=("users", "running"))
        running[pair["users"].integer(lo=1, what="a level's users")] = pair["running"].number(
            lo=0, what="the level's steady running mean")
    text = {k: keys[k].string() for k in ("url", "result") if k in keys}
    return StagingRecord(number("rejection_point", "the measured plateau in requests (or null)"),
                         number("uncertainty", "the plateau's half-width in requests (or null)"),
                         number("preemptions", "a count of preemptions (or null: the counter was absent)"),
                         running, **text)


def _looks_like_path(ref: str, base_dir: Path) -> bool:
    return ref.startswith(("/", "./", "../", "~")) or ref.endswith(".json") or (base_dir / ref).exists()


def _check_config_path(node: Node, ref: str, base_dir: Path) -> None:
    path = (base_dir / ref).expanduser()
    if not (path.is_file() or (path / "config.json").is_file()):
        raise node.error(f"a config.json file or a directory holding one (looked for {path})", ref)


def parse_model(node: Node, config_node: Node | None, base_dir: Path) -> tuple[str, str | None]:
    """`model` is what the engine serves; the theory reads its config.json from a preset, from `model`
    when that is a path (relative to the YAML file), or from `model_config`."""
    model = node.string(what="a preset Hugging Face id or a path to a config.json")
    if config_node is not None:
        config = config_node.string(what="a path to a config.json (relative to this file)")
        _check_config_path(config_node, config, base_dir)
        return model, config
    if _looks_like_path(model, base_dir):
        _check_config_path(node, model, base_dir)
        return model, None
    if model not in PRESETS:
        raise node.error(f"a preset model ({', '.join(sorted(PRESETS))}){did_you_mean(model, PRESETS)}, "
                         "a path to a config.json, or `model_config: path`", model)
    return model, None


def parse_hardware(node: Node) -> Hardware:
    """`gpu: NAME` (a known card: its memory as CUDA reports it) or `gpu_memory: SIZE` with its unit
    (GiB binary, GB decimal: kvprobe.spec.gpus), `gpu_free_memory` (a shared card: free at start; SGLang
    sizes its pool from it, vLLM only checks it at start-up), and `count`."""
    from kvprobe.spec.gpus import gpu_free_memory, gpu_memory

    keys = node.mapping(("gpu", "gpu_memory", "gpu_free_memory", "count"))
    name = keys["gpu"].string(what='a GPU name, e.g. "H100-80GB"') if "gpu" in keys else None
    memory = keys["gpu_memory"].value if "gpu_memory" in keys else None
    prefix = f"{node.path}." if node.path else ""
    said = gpu_memory(gpu=name, memory=memory, gpu_key=f"{prefix}gpu", memory_key=f"{prefix}gpu_memory",
                      file=node.file)
    free = gpu_free_memory(keys["gpu_free_memory"].value if "gpu_free_memory" in keys else None, total=said,
                           key=f"{prefix}gpu_free_memory", file=node.file)
    count = keys["count"].integer(lo=1, hi=4096, what="a number of GPUs") if "count" in keys else 1
    card = said.gpu if said else None  # a name given is a known card's (gpu_memory refuses any other)
    return Hardware(None if said is None else said.total_bytes, count, card.name if card else None, free)


def check_consistency(exp: Expectation, node: Node) -> None:
    """Rules that span keys: lengths against the engine's limits, GPUs against parallelism, the
    emulator's pool flags, and a hold long enough for a request to finish."""
    req = exp.profile.request
    total = req.prompt_tokens + req.output_tokens
    flags_node = node.child("flags")
    for flag, limit, why in length_limits(exp.engine, exp.flags):
        if total > limit:
            raise flags_node.child(flag).error(
                f"room for prompt_tokens + output_tokens = {total} of profile {exp.profile.name!r} "
                f"(largest P+O here is {limit}: {why})")
    tp, pp, dp = parallel_sizes(exp.engine, exp.flags)
    if tp * pp * dp > exp.hardware.gpu_count:
        raise node.child("hardware").child("count").error(
            f"at least {tp * pp * dp} GPUs for tp {tp} x pp {pp} x dp {dp}", exp.hardware.gpu_count)
    if exp.target.mode == "shadow":
        check_shadow(exp, node)
    if exp.target.mode == "emulator":
        pool_flag = "num-gpu-blocks-override" if exp.engine == "vllm" else "max-total-tokens"
        if pool_flag not in exp.flags:
            raise flags_node.child(pool_flag).error(
                "this flag with target launch: emulator (the emulator has no GPU to size its pool from)",
                Shown("nothing (missing)"))
        step_ms = exp.target.emulator.get("step_ms")
        hold = exp.profile.hold
        if step_ms and hold.seconds is not None:
            lifetime = (req.output_tokens + 1) * step_ms / 1000  # one prefill step + O decode steps
            if hold.seconds * (1 - hold.warmup) < lifetime:
                raise node.child("profile").child("hold").child("seconds").error(
                    f"a steady part of the hold longer than one request ({lifetime:g} s = "
                    f"{req.output_tokens + 1} steps x {step_ms:g} ms) in profile {exp.profile.name!r}",
                    hold.seconds)
    if exp.expect_fail and exp.expect_fail not in exp.checks:
        raise node.child("expect_fail").error(f"one of this expectation's checks: {', '.join(exp.checks)}",
                                              exp.expect_fail)


def parse_policy(node: Node, engine: str) -> str:
    """An admission policy named explicitly: one of the engine's (kvprobe.theory.admission.POLICIES)."""
    from kvprobe.theory.admission import POLICIES

    return node.choice([p for p in POLICIES if p.startswith(engine) or p == "worst-case"],
                       what=f"a {engine} admission policy, one of")


def check_version(node: Node, engine: str, version: str, policy: str | None) -> None:
    """A version kvprobe has no facts for is refused unless the policy is chosen explicitly."""
    from kvprobe.engines import is_known_version, unknown_version_message

    if policy is None and not is_known_version(engine, version):
        raise node.error(unknown_version_message(engine, version), version)


def _parse_expectation(node: Node, *, default_name: str | None, profile_dirs) -> Expectation:
    keys = node.mapping(EXPECTATION_KEYS, required=REQUIRED_KEYS,
                        what="an expectation mapping (engine, version, model, target, profile, ...)")
    exp_path = Path(node.file)
    if "name" in keys:
        name = keys["name"].string(pattern=NAME_RE, what="a name of letters, digits, '.', '_', '-' (max 80)")
    elif default_name is not None:
        name = default_name
    else:
        raise node.child("name").error("a name for each expectation of a list", Shown("nothing (missing)"))
    engine_node = keys["engine"]
    if isinstance(engine_node.value, str) and engine_node.value.lower() in ENGINES:
        engine = engine_node.value.lower()
    else:
        engine = engine_node.choice(ENGINES, what="an engine, one of")
    version_node = keys["version"]
    if isinstance(version_node.value, int | float) and not isinstance(version_node.value, bool):
        raise version_node.error('a version string in quotes, e.g. "0.33.0" (YAML read a number)')
    version = version_node.string(what='a version string, e.g. "0.33.0"')
    policy = parse_policy(keys["policy"], engine) if "policy" in keys else None
    check_version(version_node, engine, version, policy)
    model, model_config = parse_model(keys["model"], keys.get("model_config"), exp_path.parent)
    served = keys["served_model_name"].string() if "served_model_name" in keys else None
    target = parse_target(keys["target"])
    # Only a launched real engine reads a flag kvprobe does not know; anywhere else it is a mistake.
    flags = parse_flags(keys["flags"], engine, strict=target.mode != "launch") if "flags" in keys else {}
    hardware = parse_hardware(keys["hardware"]) if "hardware" in keys else Hardware()
    profile = resolve_profile(keys["profile"], exp_path, name, profile_dirs)
    tolerances = _parse_tolerances(keys["tolerances"]) if "tolerances" in keys else Tolerances()
    checks = (_parse_checks(keys["checks"]) if "checks" in keys
              else CHECKS + (_fleet_checks(engine) if target.fleet else ()))
    if not target.fleet and "checks" in keys and (fleet_only := [c for c in checks if c in FLEET_CHECKS]):
        raise keys["checks"].error(f"checks of one engine here ({', '.join(fleet_only)}: a fleet target only)")
    expect_fail = None
    if "expect_fail" in keys:
        expect_fail = keys["expect_fail"].choice(checks, what="one of this expectation's checks:")
    exp = Expectation(
        name=name, path=node.file, engine=engine, version=version, model=model,
        model_base_dir=str(exp_path.parent.resolve()), served_model_name=served, flags=flags,
        hardware=hardware, target=target, profile=profile, tolerances=tolerances, checks=checks,
        expect_fail=expect_fail,
        description=keys["description"].string() if "description" in keys else "",
        enabled=keys["enabled"].boolean() if "enabled" in keys else True,
        model_config=model_config,
        estimates=_parse_estimates(keys["estimates"]) if "estimates" in keys else {},
        policy=policy,
        staging=_parse_staging(keys["staging"]) if "staging" in keys else None,
    )
    if "versions" in keys or "expect_change" in keys or "repeat" in keys:
        exp = dataclasses.replace(exp, **_parse_versions(keys, engine, policy))
    check_consistency(exp, node)
    return exp


def _parse_versions(keys: dict, engine: str, policy: str | None) -> dict:
    """`versions: [A, B]` (releases kvprobe has facts for; each release's own rule, so no `policy:`),
    `expect_change: [...]` (what must change between consecutive ones: kvprobe diff's figures) and
    `repeat: N` (each release run N times: a change must show between every run of one and of the next)."""
    from kvprobe.spec.schema import CHANGE_KEYS

    if "versions" not in keys:
        key = "expect_change" if "expect_change" in keys else "repeat"
        raise keys[key].error("`versions: [A, B]` beside it (a change is between releases)", Shown("no versions"))
    node = keys["versions"]
    if policy is not None:
        raise node.error("no `policy:` beside it (each release's own rule is what is compared)", policy)
    items = node.seq(nonempty=True, what="a list of two or more versions")
    versions = tuple(item.string(what='a version string, e.g. "0.33.0"') for item in items)
    if len(versions) < 2:
        raise node.error("two or more versions", Shown(f"{len(versions)}"))
    for item, version in zip(items, versions, strict=True):
        check_version(item, engine, version, None)
    changes = ()
    if "expect_change" in keys:
        changes = tuple(n.choice(CHANGE_KEYS, what="a figure that changes, one of")
                        for n in keys["expect_change"].seq(nonempty=True, what="a list of figures"))
    repeat = keys["repeat"].integer(lo=1, what="a whole number of runs per release") if "repeat" in keys else 1
    return {"versions": versions, "expect_change": changes, "repeat": repeat}


def load_expectations(path: str | Path, *, profile_dirs=None) -> list[Expectation]:
    """The expectations of one file: one mapping, or `expectations: [ ... ]` (each with a `name`)."""
    path = Path(path)
    node = Node(read_yaml(path), str(path))
    if isinstance(node.value, dict) and "expectations" in node.value:
        top = node.mapping(("expectations", "description"))
        items = top["expectations"].seq(nonempty=True, what="a list of expectation mappings")
        found = [_parse_expectation(item, default_name=None, profile_dirs=profile_dirs) for item in items]
    elif isinstance(node.value, dict):
        found = [_parse_expectation(node, default_name=path.stem, profile_dirs=profile_dirs)]
    else:
        raise node.error("a mapping of expectation keys, or `expectations: [...]`",
                         Shown("an empty file") if node.value is None else show(node.value))
    _refuse_duplicates(found)
    return found


def _refuse_duplicates(expectations: list[Expectation]) -> None:
    seen: dict[str, Expectation] = {}
    for exp in expectations:
        first = seen.get(exp.name)
        if first is not None:
            where = "earlier in this file" if first.path == exp.path else f"also in {first.path}"
            raise spec_error(exp.path, "name", f"a unique expectation name ({exp.name!r} is {where})", exp.name)
        seen[exp.name] = exp


def load_expectation_dir(paths, *, profile_dirs=None) -> list[Expectation]:
    """All expectations of the given files and directories (a directory: its *.yaml/*.yml, not its
    subfolders); names must be unique across all of them."""
    if isinstance(paths, str | Path):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.iterdir() if f.suffix in (".yaml", ".yml") and f.is_file())
        else:
            files.append(p)  # a missing file is reported by read_yaml
    found: list[Expectation] = []
    for f in dict.fromkeys(files):
        found += load_expectations(f, profile_dirs=profile_dirs)
    _refuse_duplicates(found)
    return found


def override_profile(exp: Expectation, path_or_name: str | Path, *, search_dirs=None) -> Expectation:
    """The same expectation with another profile (a pytest/console override), re-checked."""
    dirs = search_dirs if search_dirs is not None else profile_search_dirs(exp.path)
    profile = load_profile(path_or_name, search_dirs=dirs)
    new = dataclasses.replace(exp, profile=profile)
    check_consistency(new, Node({}, exp.path))
    return new


def ledger_inputs(exp: Expectation, *, users: int | None = None):
    """The ledger's inputs for this expectation: its flags, hardware and request shape."""
    from kvprobe.theory.ledger.inputs import LedgerInputs

    return LedgerInputs(**ledger_kwargs(exp, users=users))




__all__ = [
    "CHECKS", "ENGINES", "EMULATOR_FAULTS", "RAMP_STRATEGIES", "ConfigError",
    "RequestShape", "RampSpec", "HoldSpec", "Profile", "Tolerances", "Target", "Hardware", "Expectation",
    "load_expectations", "load_expectation_dir", "ledger_inputs", "override_profile",
]
