"""An expectation's `target`: how the engine is reached — launched (the emulator, the real engine,
a shadow engine), attached at a URL, or a fleet of replicas behind a router (kvprobe.spec.fleet)."""

from __future__ import annotations

from pathlib import Path

from kvprobe.spec.fleet import parse_fleet_target
from kvprobe.spec.launch import (
    LAUNCH_KEYS,
    LAUNCH_KINDS,
    STARTUP_TIMEOUTS,
    parse_command,
    parse_emulator,
    parse_engine_args,
    parse_env,
    parse_time_model,
    resolve_relative,
)
from kvprobe.spec.node import ENV_NAME_RE, Node, Shown
from kvprobe.spec.schema import Target


def parse_target(node: Node) -> Target:
    """`{launch: emulator, ...}`, `{launch: engine, command: ..., model: ...}`, `{launch: shadow, ...}`
    or `{url: ..., api_key_env: NAME}`; every launch kind takes `port`, `startup_timeout` and `env`."""
    v = node.value
    if isinstance(v, dict) and "fleet" in v:
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
                                                "KVPROBE_API_KEY",
                                                Shown("a value that is not a variable name (not shown)"))
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
        emulator = parse_emulator(keys["emulator"]) if "emulator" in keys else {}
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
