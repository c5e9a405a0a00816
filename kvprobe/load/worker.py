"""`kvprobe worker --master HOST:PORT`: a Locust worker with kvprobe's locustfile, on any machine.

The worker needs no expectation or profile: what its requests are (model, P, O, streaming, shared
prefix, seed, the engine's path, the NAME of the API key's variable) arrives from the probe's master
with Locust's spawn message, and its records go back over the same link (`kvprobe.load.messages`),
so no folder is shared. The API key itself is read from this host's environment under that name.

The process becomes Locust (exec): signals reach it directly; it exits when the master quits.
`--processes N` forks N workers on this host (Locust's own `--processes` with `--worker`), for a load
host with more cores: one gevent process holds about 100 streams accurately (measured; kvprobe.load.health
watches its loop lag).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvprobe.errors import ConfigError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "worker", help="run a Locust load worker for a probe whose profile expects workers (`workers: {expect: N}`)",
        description="Connect to a probe's Locust master and generate its load from this machine. Start one per "
                    "load process the profile's `workers.expect` counts; each exits when the probe ends.")
    p.add_argument("--master", required=True, metavar="HOST:PORT",
                   help="the master's address, as the probe prints it (the profile's workers.bind)")
    p.add_argument("--processes", type=int, default=1,
                   help="Locust worker processes to fork on this host (each counts as one worker; default 1)")
    p.add_argument("--loglevel", default="WARNING", help="Locust's log level (default WARNING)")
    p.set_defaults(func=run)


def command(master: str, *, processes: int = 1, loglevel: str = "WARNING") -> list[str]:
    """The Locust command line of a worker (what `run` execs)."""
    from kvprobe.load.messages import split_host_port
    from kvprobe.load.runner import LOCUSTFILE

    try:
        host, port = split_host_port(master)
    except ValueError as err:
        raise ConfigError(f"--master: expected {err}, got {master!r}") from None
    if port is None:
        raise ConfigError(f"--master: expected HOST:PORT with the port the probe prints, got {master!r}")
    if processes < 1:
        raise ConfigError(f"--processes: expected a number of worker processes >= 1, got {processes}")
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker", "--master-host", host,
           "--master-port", str(port), "--loglevel", loglevel, "--kv-transport", "message"]
    if processes > 1:
        cmd += ["--processes", str(processes)]
    return cmd


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LOCUST_SKIP_MONKEY_PATCH", None)  # the locustfile needs gevent's patch (locust/__init__.py)
    root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run(args) -> int:
    cmd = command(args.master, processes=args.processes, loglevel=args.loglevel)
    print(f"kvprobe worker: connecting to the probe's master at {args.master} "
          f"({args.processes} process{'es' if args.processes > 1 else ''}); exits when the probe ends", flush=True)
    os.execve(cmd[0], cmd, environment())
    return 0  # not reached
