"""`target: {fleet: ...}` in an expectation: R replicas of the expectation's engine configuration
behind sglang-router, launched or attached.

    target:
      fleet: {replicas: 3, router: sglang-router, policy: round_robin}
      emulator: {step_ms: 20}        # each replica: the emulator (the only launch kind for now)

    target:
      fleet:
        url: http://router:30000     # attach: the router, and every replica it routes to
        replicas: [http://r0:8000, http://r1:8000]
        policy: round_robin
      api_key_env: KVPROBE_API_KEY
"""

from __future__ import annotations

from kvprobe.spec.launch import STARTUP_TIMEOUTS, parse_emulator, parse_env
from kvprobe.spec.node import Shown
from kvprobe.spec.schema import Target
from kvprobe.targets.fleet import router as rt

ROUTERS = (rt.NAME,)
MAX_REPLICAS = 64


def _url(node) -> str:
    url = node.string(what="an http:// or https:// URL")
    if "@" in url.split("://", 1)[-1].split("/", 1)[0]:
        raise node.error("a URL without credentials (name the key's variable in target.api_key_env)",
                         Shown("a URL with credentials (not shown)"))
    if not url.startswith(("http://", "https://")) or not url.split("://", 1)[1].strip("/"):
        raise node.error("an http:// or https:// URL")
    return url.rstrip("/")


def parse_fleet_target(node) -> Target:
    """`target: {fleet: ...}`: launched emulator replicas, or an attached router and its replicas."""
    keys = node.mapping(("fleet", "launch", "emulator", "startup_timeout", "env", "api_key_env"))
    fleet = keys["fleet"]
    attach = isinstance(fleet.value, dict) and "url" in fleet.value
    fk = fleet.mapping(("url", "replicas", "router", "policy"), required=("replicas",),
                       what="a fleet: {replicas: N, router: sglang-router, policy: round_robin}")
    router = fk["router"].choice(ROUTERS, what="a router kvprobe launches, one of") if "router" in fk else rt.NAME
    policy = fk["policy"].choice(rt.POLICIES, what="a policy of sglang-router 0.3.2, one of") \
        if "policy" in fk else "round_robin"
    if attach:
        for key in ("launch", "emulator", "env"):
            if key in keys:
                raise keys[key].error("nothing here: an attached fleet is already running (target.fleet.url)")
        urls = [_url(n) for n in fk["replicas"].seq(nonempty=True, what="the replicas' URLs (a list)")]
        env = keys["api_key_env"].string() if "api_key_env" in keys else None
        return Target("url", url=_url(fk["url"]), api_key_env=env,
                      fleet={"replicas": len(urls), "replica_urls": urls, "router": router, "policy": policy})
    if "api_key_env" in keys:
        raise keys["api_key_env"].error("nothing here: launched replicas take no API key")
    if "launch" in keys:
        keys["launch"].choice(("emulator",), what="emulator: fleet replicas are launched as the emulator; one of")
    replicas = fk["replicas"].integer(lo=1, hi=MAX_REPLICAS, what="a number of replicas")
    timeout = (keys["startup_timeout"].number(lo=0, hi=7200, lo_open=True, what="seconds")
               if "startup_timeout" in keys else STARTUP_TIMEOUTS["emulator"])
    emulator = parse_emulator(keys["emulator"]) if "emulator" in keys else {}
    env = parse_env(keys["env"], "emulator") if "env" in keys else {}
    return Target("emulator", startup_timeout=timeout, emulator=emulator, env=env,
                  fleet={"replicas": replicas, "router": router, "policy": policy})
