"""`kvprobe shadow sglang --model-path MODEL [SGLang flags]`: real SGLang on this machine, model-less.

The server runs from kvprobe's engine environment with kvprobe's plugin
(`kvprobe/targets/shadow/sglang/plugin.py`) until Ctrl-C or until it exits; it is started and stopped
as one process group, like a probe's target.
SGLang's own flags are accepted by their real names (the dialect's FLAGS and OTHER_FLAGS), so a
command line written for a GPU runs here unchanged; kvprobe's own: --gpu-memory, --engine-version,
the time model, --log.
"""

from __future__ import annotations

import argparse
import time

from kvprobe.cli.common import add_gpu_arguments, gpu_from_args
from kvprobe.engines import sglang as dialect
from kvprobe.theory.sim.steptime import TimeModel

_TM = TimeModel()
STARTUP_TIMEOUT = 300.0  # seconds; SGLang 0.5.23 starts in 20-60 s here, slower on a loaded machine


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1-65535, got {text!r}")
    return port


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("sglang", help="run real SGLang without a model (kvprobe's plugin)",
                       description=__doc__.splitlines()[0])
    p.add_argument("--model-path", dest="model", required=True,
                   help="a preset id (served under that name) or a config.json path; no weights are read")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=dialect.DEFAULT_PORT)
    p.add_argument("--engine-version", default=dialect.DEFAULT_VERSION, help="the engine environment's version")
    add_gpu_arguments(p, memory_help="size the pool as a GPU of this memory would, with its unit: 79.2GiB (binary) "
                      "or 85GB (decimal); else --max-total-tokens")
    p.add_argument("--log", default=None, metavar="FILE", help="engine log (default: a file in the cache folder)")
    tm = p.add_argument_group("time model (one step = step-ms + prefill + decode terms)")
    tm.add_argument("--step-ms", type=float, default=_TM.step_ms)
    tm.add_argument("--prefill-us-per-token", type=float, default=_TM.prefill_us_per_token)
    tm.add_argument("--decode-us-per-seq", type=float, default=_TM.decode_us_per_seq)
    eng = p.add_argument_group("SGLang flags (passed through by their real names)")
    for flag in dialect.FLAGS.values():
        if flag.type is None:
            eng.add_argument(f"--{flag.name}", dest=f"sgl_{flag.dest}", action="store_true", default=None,
                             help=flag.help)
        else:
            eng.add_argument(f"--{flag.name}", dest=f"sgl_{flag.dest}", default=None, metavar="VALUE",
                             help=flag.help)
    for name in dialect.OTHER_FLAGS:
        eng.add_argument(f"--{name}", dest=f"sgl_{name.replace('-', '_')}", nargs="?", const=True, default=None,
                         metavar="VALUE", help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p


def engine_flags(args) -> dict[str, object]:
    names = [*dialect.FLAGS, *dialect.OTHER_FLAGS]
    values = {n: getattr(args, "sgl_" + n.replace("-", "_")) for n in names}
    return {n: v for n, v in values.items() if v is not None}


def _hybrid_pools(log: str) -> str:
    """The pools beside the full one, as SGLang logged them (dialect.parse_hybrid_startup)."""
    try:
        with open(log, errors="replace") as fh:
            said = dialect.parse_hybrid_startup(fh.read())
    except OSError:
        return ""
    parts = [f"window pool {said['swa_tokens']} tokens"] if "swa_tokens" in said else []
    if "mamba_slots" in said:
        parts.append(f"{said['mamba_slots']} recurrent-state slots")
    return f" (full layers; {', '.join(parts)})" if parts else ""


def run(args) -> int:
    from kvprobe.procgroup import sigterm_as_interrupt

    with sigterm_as_interrupt():  # the finally below stops everything it started, on SIGTERM too
        return _run(args)


def _run(args) -> int:
    from kvprobe.targets.shadow import launch
    from kvprobe.targets.shadow.envs import cache_root
    from kvprobe.targets.shadow.target import ShadowTarget
    from kvprobe.theory.model.geometry import load_model_config

    gpu = gpu_from_args(args)
    if gpu is not None:
        print(f"kvprobe shadow: {gpu.said}", flush=True)
    config, _ = load_model_config(args.model)
    flags = engine_flags(args)
    req = launch.ShadowLaunch(
        engine="sglang", version=args.engine_version, model=args.model, config=config,
        served_model_name=str(flags.get("served-model-name") or args.model), flags=flags, host=args.host,
        port=args.port, gpu_memory_bytes=None if gpu is None else gpu.total_bytes,
        time_model=TimeModel(args.step_ms, args.prefill_us_per_token, args.decode_us_per_seq))
    argv, environ = launch.command(req)
    log = args.log or str(cache_root() / "logs" / f"shadow-sglang-{args.port}.log")
    print(f"kvprobe shadow: starting SGLang {args.engine_version} (log {log})", flush=True)
    target = ShadowTarget.launch(argv, engine="sglang", port=args.port, host=args.host, log_path=log,
                           startup_timeout=STARTUP_TIMEOUT, env=environ)
    with target:
        facts = target.facts()
        rep = facts.reported
        print(f"kvprobe shadow: SGLang ready at {target.url} as {req.served_model_name!r} (process group "
              f"{target.pgid}): pool {rep.kv_tokens} tokens{_hybrid_pools(log)}, max_running_requests "
              f"{rep.max_running}, context {rep.max_model_len}; plugin {facts.shadow or 'silent'}; Ctrl-C stops it",
              flush=True)
        try:
            while target.alive():
                time.sleep(0.5)  # waiting for Ctrl-C or the server's own exit
        except KeyboardInterrupt:
            print("kvprobe shadow: stopping", flush=True)
            return 0
    target.ensure_alive()  # it exited by itself: the exit code and the log's tail
    return 0
