"""`kvprobe shadow vllm MODEL [vllm serve flags]`: the real `vllm serve` with kvprobe's model-less worker.

The counterpart of `kvprobe emulate vllm`: a server on 127.0.0.1 that speaks vLLM's API and metrics,
except that here every line of the serving stack is vLLM's own (the installed release, from the
engine environment made by `kvprobe shadow install vllm==VERSION`). MODEL is a preset id or a path
to a config.json; any flag kvprobe does not take for itself is passed to `vllm serve` as written.
The process becomes `vllm serve` (exec), so Ctrl-C and signals reach vLLM directly.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvprobe.cli.common import add_gpu_arguments, gpu_from_args
from kvprobe.engines import vllm as dialect
from kvprobe.errors import ConfigError
from kvprobe.theory.sim.steptime import TimeModel

_TM = TimeModel()


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("vllm", help="serve a model with the real vLLM and no model weights", allow_abbrev=False,
                       description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("model", help="a preset id (e.g. meta-llama/Llama-3.1-8B) or a path to a config.json")
    p.add_argument("--engine-version", default=dialect.DEFAULT_VERSION,
                   help="the vLLM version to run (its engine environment)")
    add_gpu_arguments(p, memory_help="size the pool as a GPU of this memory would, with its unit: 79.2GiB (binary) "
                      "or 85GB (decimal); else --num-gpu-blocks-override or --kv-cache-memory-bytes")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=dialect.DEFAULT_PORT)
    tm = p.add_argument_group("step time model (one step = step-ms + prefill + decode terms; the emulator's)")
    tm.add_argument("--step-ms", type=float, default=_TM.step_ms)
    tm.add_argument("--prefill-us-per-token", type=float, default=_TM.prefill_us_per_token)
    tm.add_argument("--decode-us-per-seq", type=float, default=_TM.decode_us_per_seq)
    p.set_defaults(func=run, passthrough=True)
    return p


def flags_from_argv(argv: list[str]) -> dict[str, object]:
    """`--x v` / `--x=v` / `--x` / `--no-x` -> {x: v | True | False}, typed and checked like an
    expectation's `flags:` (the same table, the same one-line errors)."""
    from kvprobe.spec.flags import parse_flags
    from kvprobe.spec.node import Node

    flags: dict[str, object] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"expected a vLLM flag (--name [value]), got {token!r}", key="command line")
        name, eq, value = token[2:].partition("=")
        known = dialect.FLAGS.get(name) or dialect.FLAGS.get(name.removeprefix("no-"))
        if eq:
            flags[name] = value
        elif name.startswith("no-") and (known is None or known.type is None):
            flags[name[3:]] = False
        elif (known is not None and known.type is None) or i + 1 >= len(argv) or argv[i + 1].startswith("--"):
            flags[name] = True
        else:
            flags[name] = argv[i + 1]
            i += 1
        i += 1
    for name, value in list(flags.items()):
        flag = dialect.FLAGS.get(name)
        if (flag is not None and flag.type in (int, float) and isinstance(value, str)
                and flag.value_kind in ("int", "float")):
            try:
                flags[name] = flag.type(value)
            except ValueError:
                raise ConfigError(f"--{name}: expected a number, got {value!r}", key="command line") from None
    served = flags.pop("served-model-name", None)
    out = parse_flags(Node(flags, "command line", ""), "vllm")
    if served is not None:
        out["served-model-name"] = served
    return out


def run(args) -> int:
    from kvprobe.targets.shadow import launch
    from kvprobe.theory.model.geometry import load_model_config

    flags = flags_from_argv(list(args.extra))
    served = str(flags.pop("served-model-name", args.model))
    config, _ = load_model_config(args.model, base_dir=os.getcwd())
    gpu_said = gpu_from_args(args)
    gpu = None if gpu_said is None else gpu_said.total_bytes
    req = launch.ShadowLaunch(
        engine="vllm", version=args.engine_version, model=args.model, config=config, served_model_name=served,
        flags=flags, host=args.host, port=args.port, gpu_memory_bytes=gpu,
        gpu_capability=None if gpu_said is None or gpu_said.gpu is None else gpu_said.gpu.capability,
        time_model=TimeModel(args.step_ms, args.prefill_us_per_token, args.decode_us_per_seq))
    argv, environ = launch.command(req)
    if gpu_said is not None:
        print(f"kvprobe shadow: {gpu_said.said}", file=sys.stderr, flush=True)
    print("kvprobe shadow: " + " ".join(argv), file=sys.stderr, flush=True)
    os.execve(argv[0], argv, {**os.environ, "PYTHONUNBUFFERED": "1", **environ})
    return 0  # not reached
