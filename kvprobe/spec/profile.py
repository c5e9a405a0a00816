"""Load profiles (`loadprofiles/*.yaml`, or inline in an expectation): a workload — the request
shape (P, O, streaming, a shared prefix), the ramp, the hold per level, the sampling interval, the
time budget and the Locust processes or workers. Validated on load like an expectation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvprobe.errors import spec_error
from kvprobe.load.messages import split_host_port
from kvprobe.spec.node import NAME_RE, Node, Shown, did_you_mean, read_yaml
from kvprobe.spec.schema import (
    MIN_STEADY_SAMPLES,
    RAMP_STRATEGIES,
    HoldSpec,
    Profile,
    RampSpec,
    RequestShape,
    WorkersSpec,
)

PROFILE_KEYS = ("name", "description", "request", "ramp", "hold", "sampling", "budget_seconds", "drain_seconds",
                "processes", "workers")
RAMP_KEYS = {
    "explicit": ("strategy", "levels"),
    "around-prediction": ("strategy", "below", "window", "above", "max_users"),
    "bisect": ("strategy", "max_users", "confirm"),
    "predict": ("strategy", "max_users", "uncertainty"),
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
    if "uncertainty" in keys:
        values["uncertainty"] = keys["uncertainty"].number(
            lo=0, lo_open=True, what="the rejection point's half-width in requests to hold for")
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
    processes = (keys["processes"].integer(lo=1, hi=256, what="a number of Locust processes")
                 if "processes" in keys else 1)
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


def resolve_profile(node: Node, exp_path: Path, exp_name: str, profile_dirs) -> Profile:
    """An expectation's `profile:`: inline, a path beside the file, or a name from the search dirs."""
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
