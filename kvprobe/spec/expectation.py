"""The files a user writes: load profiles (`loadprofiles/*.yaml`) and expectations (`expectations/*.yaml`).

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
from kvprobe.spec.launch import (
    LAUNCH_KEYS,
    LAUNCH_KINDS,
    STARTUP_TIMEOUTS,
    check_shadow,
    parse_command,
    parse_engine_args,
    parse_env,
    parse_time_model,
    resolve_relative,
)
from kvprobe.spec.schema import (
    CHECKS,
    EMULATOR_FAULTS,
    ENGINES,
    ENV_NAME_RE,
    ESTIMATE_KEYS,
    FLEET_CHECKS,
    MIN_STEADY_SAMPLES,
    NAME_RE,
    RAMP_STRATEGIES,
    Expectation,
    Hardware,
    HoldSpec,
    Node,
    Profile,
    RampSpec,
    RequestShape,
    Shown,
    Target,
    Tolerances,
    WorkersSpec,
    did_you_mean,
    ledger_kwargs,
    length_limits,
    parallel_sizes,
    parse_flags,
    parse_units,
    read_yaml,
    show,
)

# -- profiles ---------------------------------------------------------------------------------

PROFILE_KEYS = ("name", "description", "request", "ramp", "hold", "sampling", "budget_seconds", "drain_seconds",
                "processes", "workers")
RAMP_KEYS = {
    "explicit": ("strategy", "levels"),
    "around-prediction": ("strategy", "below", "window", "above", "max_users"),
    "bisect": ("strategy", "max_users", "confirm"),
}


def _parse_request(node: Node) -> RequestShape:
    keys = node.mapping(("prompt_tokens", "output_tokens", "stream", "shared_prefix_tokens"),
                        required=("prompt_tokens", "output_tokens"))
    p = keys["prompt_tokens"].integer(lo=1, what="a whole number of prompt tokens")
    o = keys["output_tokens"].integer(lo=1, what="a whole number of output tokens")
    stream = keys["stream"].boolean() if "stream" in keys else True
    k = 0
    if "shared_prefix_tokens" in keys:
        # K identical tokens open every prompt; the token after them makes each prompt unique
        k = keys["shared_prefix_tokens"].integer(
            lo=0, hi=p - 1, what=f"a whole number of tokens shared by every prompt, less than prompt_tokens ({p})")
    return RequestShape(p, o, stream, k)


def _parse_ramp(node: Node) -> RampSpec:
    if not isinstance(node.value, dict):
        raise node.error("a mapping with `strategy` and its settings")
    strategy = node.child("strategy")
    if strategy.value is None:
        raise strategy.error("this key to be present", Shown("nothing (missing)"))
    strategy_name = strategy.choice(RAMP_STRATEGIES, what="a ramp strategy, one of")
    keys = node.mapping(RAMP_KEYS[strategy_name], required=("levels",) if strategy_name == "explicit" else ())
    if strategy_name == "explicit":
        levels = [n.integer(lo=1, what="a user count") for n in keys["levels"].seq(
            nonempty=True, what="a list of user counts (an empty ramp measures nothing)")]
        if len(set(levels)) != len(levels):
            dup = next(x for x in levels if levels.count(x) > 1)
            raise keys["levels"].error("distinct user counts", Shown(f"{dup} twice"))
        return RampSpec("explicit", levels=tuple(levels))
    spec = RampSpec(strategy_name)
    values = {}
    for key in ("below", "window", "above"):
        if key in keys:
            values[key] = keys[key].integer(lo=0, what="a number of levels")
    if "confirm" in keys:
        values["confirm"] = keys["confirm"].integer(lo=1, what="a number of confirming levels")
    if "max_users" in keys:
        values["max_users"] = keys["max_users"].integer(lo=1, what="a user count")
    return dataclasses.replace(spec, **values)


def _parse_hold(node: Node) -> HoldSpec:
    keys = node.mapping(("seconds", "lifetimes", "warmup"))
    if ("seconds" in keys) == ("lifetimes" in keys):
        raise node.error("exactly one of hold.seconds or hold.lifetimes",
                         Shown("both" if "seconds" in keys else "neither"))
    seconds = keys["seconds"].number(lo=0, lo_open=True, what="seconds") if "seconds" in keys else None
    # A level shorter than one request lifetime never reaches a steady state.
    lifetimes = (keys["lifetimes"].number(lo=1, what="request lifetimes (a level must outlast a request)")
                 if "lifetimes" in keys else None)
    warmup = keys["warmup"].number(lo=0, hi=0.9, what="a warm-up fraction of the hold") if "warmup" in keys else 0.3
    return HoldSpec(seconds, lifetimes, warmup)


def _parse_profile(node: Node, *, name: str, path: str | None) -> Profile:
    keys = node.mapping(PROFILE_KEYS, required=("request", "ramp", "hold"),
                        what="a profile mapping with request, ramp and hold")
    if "name" in keys:
        name = keys["name"].string(pattern=NAME_RE, what="a profile name of letters, digits, '.', '_', '-'")
    request = _parse_request(keys["request"])
    ramp = _parse_ramp(keys["ramp"])
    hold = _parse_hold(keys["hold"])
    interval = 0.1
    if "sampling" in keys:
        sampling = keys["sampling"].mapping(("interval",))
        if "interval" in sampling:
            interval = sampling["interval"].number(lo=0.005, hi=1.0, what="a sampling interval in seconds")
    budget = keys["budget_seconds"].number(lo=0, lo_open=True, what="seconds") if "budget_seconds" in keys else 120.0
    drain = keys["drain_seconds"].number(lo=0, lo_open=True, what="seconds") if "drain_seconds" in keys else 10.0
    processes = keys["processes"].integer(lo=1, hi=256, what="a number of Locust processes") if "processes" in keys else 1
    if hold.seconds is not None and hold.seconds * (1 - hold.warmup) < MIN_STEADY_SAMPLES * interval:
        need = MIN_STEADY_SAMPLES * interval / (1 - hold.warmup)
        raise keys["hold"].child("seconds").error(
            f"a hold of at least {need:.2f} s ({MIN_STEADY_SAMPLES} samples at {interval:g} s after "
            f"{hold.warmup:g} warm-up)")
    if ramp.strategy == "explicit" and hold.seconds is not None:
        needed = len(ramp.levels) * hold.seconds + drain
        if needed > budget:
            where = keys["budget_seconds"] if "budget_seconds" in keys else node.child("budget_seconds")
            raise where.error(f"a budget of at least {needed:g} s ({len(ramp.levels)} levels x "
                              f"{hold.seconds:g} s hold + {drain:g} s drain)", Shown(f"{budget:g}"))
    description = keys["description"].string() if "description" in keys else ""
    workers = _parse_workers(keys["workers"]) if "workers" in keys else None
    if workers is not None and processes != 1:
        raise keys["processes"].error(
            "1 (or no `processes`) when `workers` is set: the master then starts no load process of its own; "
            "run `kvprobe worker --processes N` on a load host instead", Shown(f"{processes}"))
    return Profile(name, path, request, ramp, hold, interval, budget, drain, processes, description, workers)


def _parse_workers(node: Node) -> WorkersSpec:
    """`workers: {expect: N, bind: HOST[:PORT], wait_seconds: S}` (kvprobe.load.worker)."""
    from kvprobe.load.messages import split_host_port

    keys = node.mapping(("expect", "bind", "wait_seconds"), required=("expect",),
                        what="a mapping with expect (the number of `kvprobe worker` processes) and optional bind")
    expect = keys["expect"].integer(lo=1, hi=1024, what="a number of Locust workers to wait for")
    host, port = "127.0.0.1", None
    if "bind" in keys:
        bind = keys["bind"]
        if not isinstance(bind.value, str):
            raise bind.error("HOST:PORT (or HOST) the master listens on, e.g. 0.0.0.0:5557")
        try:
            host, port = split_host_port(bind.value)
        except ValueError as err:
            raise bind.error(str(err), Shown(repr(bind.value))) from None
    wait = (keys["wait_seconds"].number(lo=0, lo_open=True, what="seconds to wait for the workers")
            if "wait_seconds" in keys else 60.0)
    return WorkersSpec(expect, host, port, wait)


# The profiles shipped with kvprobe (package data): found by name from any folder, after the user's own.
SHIPPED_PROFILES = Path(__file__).resolve().parent.parent / "loadprofiles"


def shipped_profiles() -> dict[str, Path]:
    """name -> file of every profile installed with kvprobe."""
    return {p.stem: p for p in sorted(SHIPPED_PROFILES.glob("*.y*ml"))}


def _profile_file(ref: str, search_dirs) -> Path | None:
    for d in search_dirs:
        for ext in (".yaml", ".yml"):
            candidate = Path(d) / f"{ref}{ext}"
            if candidate.is_file():
                return candidate
    return None


def _is_path(ref: str) -> bool:
    return "/" in ref or "\\" in ref or ref.endswith((".yaml", ".yml"))


def load_profile(path_or_name: str | Path, *, search_dirs=()) -> Profile:
    """A profile from a path, or by name from `search_dirs` (`short` -> `<dir>/short.yaml`), then from
    the profiles shipped with kvprobe."""
    ref = str(path_or_name)
    dirs = [*search_dirs, SHIPPED_PROFILES]
    path = Path(ref) if _is_path(ref) else _profile_file(ref, dirs)
    if path is None:
        known = sorted({p.stem for d in dirs for p in Path(d).glob("*.y*ml")})
        raise spec_error(ref, "(file)", f"a profile name ({', '.join(known) or 'none found'})"
                         f"{did_you_mean(ref, known)} or a path to a profile YAML file", Shown("not found"))
    return _parse_profile(Node(read_yaml(path), str(path)), name=path.stem, path=str(path))


def profile_search_dirs(expectation_path: str | Path) -> list[Path]:
    """Where a profile name in an expectation is looked up: `loadprofiles/` beside the file or in any
    of its three nearest parents (so `expectations/faults/x.yaml` finds `loadprofiles/`), then the
    current directory's."""
    here = Path(expectation_path).resolve().parent
    dirs = [p / "loadprofiles" for p in [here, *list(here.parents)[:3]]]
    cwd = Path.cwd() / "loadprofiles"
    return [d for d in dict.fromkeys([*dirs, cwd, SHIPPED_PROFILES]) if d.is_dir()]


# -- expectations -----------------------------------------------------------------------------

EXPECTATION_KEYS = ("name", "description", "enabled", "engine", "version", "policy", "model", "model_config",
                    "served_model_name", "flags", "hardware", "target", "profile", "tolerances", "checks",
                    "expect_fail", "estimates")
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


def _resolve_profile(node: Node, exp_path: Path, exp_name: str, profile_dirs) -> Profile:
    if isinstance(node.value, dict):
        return _parse_profile(node, name=f"{exp_name}-inline", path=None)
    ref = node.string(what="a profile name, a path to a profile YAML file, or an inline mapping")
    if _is_path(ref):
        path = (exp_path.parent / ref)
        if not path.is_file():
            raise node.error(f"a profile file (looked for {path})", ref)
    else:
        dirs = profile_dirs if profile_dirs is not None else profile_search_dirs(exp_path)
        dirs = list(dict.fromkeys([*dirs, SHIPPED_PROFILES]))
        path = _profile_file(ref, dirs)
        if path is None:
            known = sorted({p.stem for d in dirs for p in Path(d).glob("*.y*ml")})
            raise node.error(f"a profile in {', '.join(map(str, dirs)) or 'loadprofiles/ (none found)'}: "
                             f"{', '.join(known) or 'none'}{did_you_mean(ref, known)}", ref)
    return _parse_profile(Node(read_yaml(path), str(path)), name=path.stem, path=str(path))


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
    try:
        from kvprobe.theory.model.geometry import PRESETS
    except ImportError:  # theory not installed yet: any id is accepted, the ledger will judge it
        return model, None
    if model not in PRESETS:
        raise node.error(f"a preset model ({', '.join(sorted(PRESETS))}){did_you_mean(model, PRESETS)}, "
                         "a path to a config.json, or `model_config: path`", model)
    return model, None


def parse_hardware(node: Node) -> Hardware:
    keys = node.mapping(("gpu", "gpu_memory", "count"))
    name = keys["gpu"].string(what='a GPU name, e.g. "H100-80GB"') if "gpu" in keys else None
    memory = None
    if "gpu_memory" in keys:
        memory = parse_units(keys["gpu_memory"], "bytes")
        if memory < 2**30:  # a bare number is bytes; 80 means 80 bytes, never 80 GiB
            raise keys["gpu_memory"].error("a memory size per GPU with units, e.g. 80GiB (at least 1 GiB)")
    count = keys["count"].integer(lo=1, hi=4096, what="a number of GPUs") if "count" in keys else 1
    return Hardware(memory, count, name)


def _parse_emulator(node: Node) -> dict:
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


def parse_target(node: Node) -> Target:
    """`{launch: emulator, ...}`, `{launch: engine, command: ..., model: ...}`, `{launch: shadow, ...}`
    or `{url: ..., api_key_env: NAME}`; every launch kind takes `port`, `startup_timeout` and `env`."""
    v = node.value
    if isinstance(v, dict) and "fleet" in v:
        from kvprobe.spec.fleet import parse_fleet_target

        return parse_fleet_target(node)
    if not isinstance(v, dict):
        raise node.error("a mapping: {launch: emulator}, {launch: engine}, {launch: shadow} or {url: http://...}")
    if "api_key" in v:  # never echo it: the value is a secret
        raise node.child("api_key").error(
            "no key here: name an environment variable in target.api_key_env (secrets never live in YAML)",
            Shown("an inline key (not shown)"))
    if "url" in v and "launch" in v:
        raise node.error("either `url` (attach) or `launch` (start), not both", Shown("both"))
    if "url" in v:
        keys = node.mapping(("url", "api_key_env"))
        url = keys["url"].string(what="an http:// or https:// URL")
        if "@" in url.split("://", 1)[-1].split("/", 1)[0]:  # user:password@host: never echo it
            raise keys["url"].error("a URL without credentials (name the key's variable in target.api_key_env)",
                                    Shown("a URL with credentials (not shown)"))
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
            raise keys["url"].error("an http:// or https:// URL")
        env = None
        if "api_key_env" in keys:
            env = keys["api_key_env"].value
            if not isinstance(env, str) or not ENV_NAME_RE.match(env):
                raise keys["api_key_env"].error("the NAME of an environment variable holding the key, e.g. "
                                                "KVPROBE_API_KEY", Shown("a value that is not a variable name (not shown)"))
        return Target("url", url=url.rstrip("/"), api_key_env=env)
    if "launch" not in v:
        raise node.error("`launch: emulator`, `launch: engine`, `launch: shadow` or `url: http://...`",
                         Shown("neither launch nor url"))
    kind = node.child("launch").choice(LAUNCH_KINDS, what="one of")
    keys = node.mapping(("launch", "port", "startup_timeout", "env") + LAUNCH_KEYS[kind])
    port = keys["port"].integer(lo=1, hi=65535, what="a TCP port") if "port" in keys else None
    timeout = (keys["startup_timeout"].number(lo=0, hi=7200, lo_open=True, what="seconds")
               if "startup_timeout" in keys else STARTUP_TIMEOUTS[kind])
    env = parse_env(keys["env"], kind) if "env" in keys else {}
    if kind == "emulator":
        emulator = _parse_emulator(keys["emulator"]) if "emulator" in keys else {}
        return Target("emulator", startup_timeout=timeout, port=port, emulator=emulator, env=env)
    if kind == "shadow":
        time_model = parse_time_model(keys["time_model"]) if "time_model" in keys else {}
        engine_args = parse_engine_args(keys["engine_args"]) if "engine_args" in keys else ()
        return Target("shadow", startup_timeout=timeout, port=port, env=env, time_model=time_model,
                      engine_args=engine_args)
    base = Path(node.file).parent
    command = parse_command(keys["command"], base) if "command" in keys else None
    model = None
    if "model" in keys:
        model = resolve_relative(keys["model"].string(what="the model the engine loads (a path or a hub id)"), base)
    return Target("launch", command=command, startup_timeout=timeout, port=port, env=env, model=model)


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
    profile = _resolve_profile(keys["profile"], exp_path, name, profile_dirs)
    tolerances = _parse_tolerances(keys["tolerances"]) if "tolerances" in keys else Tolerances()
    checks = _parse_checks(keys["checks"]) if "checks" in keys else CHECKS + (_fleet_checks(engine) if target.fleet else ())
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
    )
    check_consistency(exp, node)
    return exp


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


def served_name(exp: Expectation) -> str:
    """The model name clients send (and the engine must serve): `served_model_name`, else `model`."""
    return exp.served_model_name or exp.model


def launched_model(exp: Expectation) -> str:
    """What a launched engine loads: `target.model` when given, else the theory's `model`."""
    return exp.target.model or exp.model


def ledger_inputs(exp: Expectation, *, users: int | None = None):
    """The ledger's inputs for this expectation: its flags, hardware and request shape."""
    from kvprobe.theory.ledger.inputs import LedgerInputs

    return LedgerInputs(**ledger_kwargs(exp, users=users))




__all__ = [
    "CHECKS", "ENGINES", "EMULATOR_FAULTS", "RAMP_STRATEGIES", "ConfigError",
    "RequestShape", "RampSpec", "HoldSpec", "Profile", "Tolerances", "Target", "Hardware", "Expectation",
    "load_profile", "load_expectations", "load_expectation_dir", "ledger_inputs", "override_profile",
    "profile_search_dirs", "shipped_profiles", "SHIPPED_PROFILES",
]
