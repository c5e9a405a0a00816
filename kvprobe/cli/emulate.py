"""`kvprobe emulate vllm|sglang [flags]`: an engine without a model.

Engine flags carry the real names, types and defaults (from the dialect modules), so an expectation
written for the emulator reads like one for the real engine. The emulator's own flags: the time
model (--step-ms, --prefill-us-per-token, --decode-us-per-seq), --seed, --fault, --trace.
"""

from __future__ import annotations

import argparse

from kvprobe.engines import get_dialect
from kvprobe.releases import ENGINES
from kvprobe.targets.emulator.faults import FAULTS
from kvprobe.theory.sim.steptime import TimeModel
from kvprobe.theory.vllm.hybrid.kv_cache_spec import CAPABILITY_FORM

_TM = TimeModel()
# A packaged preset: `kvprobe probe --url` against the emulator finds the model's geometry by its
# served name, as it would for a real engine serving that model.
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B"


def _capability(text: str) -> str:
    if not CAPABILITY_FORM.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected a compute capability such as 8.0 or 9.0, got {text!r}")
    return text


def _add_engine(sub, engine: str) -> None:
    d = get_dialect(engine)
    p = sub.add_parser(engine, help=f"emulate {engine} {d.DEFAULT_VERSION}",
                       description=f"Emulated {engine}: real HTTP API, /metrics and admission policy, no model.")
    if engine == "vllm":
        # `vllm serve MODEL` takes the model positionally; accepting it too makes the emulator a
        # drop-in for the real command line built by the launcher.
        p.add_argument("model_tag", nargs="?", default=None, help="model name, as `vllm serve MODEL`")
        p.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"model name (vllm serve's model_tag; default {DEFAULT_MODEL})")
    else:
        p.add_argument("--model-path", dest="model", default=DEFAULT_MODEL,
                       help=f"model path / name (default {DEFAULT_MODEL})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=d.DEFAULT_PORT)
    for flag in d.FLAGS.values():
        if not flag.emulated:
            continue
        opt = f"--{flag.name}"
        if flag.type is None and flag.negatable:
            p.add_argument(opt, dest=flag.dest, action=argparse.BooleanOptionalAction, default=flag.default,
                           help=flag.help)
        elif flag.type is None:
            p.add_argument(opt, dest=flag.dest, action="store_true", default=flag.default, help=flag.help)
        else:
            # None = not given: the emulator then runs the default, and says so where the engine does
            # (vLLM's cache_config_info user_specified_block_size, SGLang's /server_info raw fields).
            shown = "" if flag.default is None else f" (default {flag.default})"
            p.add_argument(opt, dest=flag.dest, type=flag.type, default=None, help=flag.help + shown)
    p.add_argument("--engine-version", default=d.DEFAULT_VERSION,
                   help="the release to behave as (vLLM 0.11 admits on a prompt's first chunk and refuses "
                        "P + max_tokens over max-model-len with a 400; SGLang up to 0.5.21 reserves output room "
                        "by a ratio)")
    tm = p.add_argument_group("emulator time model (one step = step-ms + prefill + decode terms)")
    tm.add_argument("--step-ms", type=float, default=_TM.step_ms, help="fixed cost per engine step (ms)")
    tm.add_argument("--prefill-us-per-token", type=float, default=_TM.prefill_us_per_token)
    tm.add_argument("--decode-us-per-seq", type=float, default=_TM.decode_us_per_seq)
    if engine == "vllm":
        p.add_argument("--gpu-capability", default=None, metavar="MAJOR.MINOR", type=_capability,
                       help="the emulated card's compute capability, where vLLM picks a kernel by it (a Gated "
                            "DeltaNet layer's prefill; default 9.0, a Hopper, as the ledger)")
    p.add_argument("--seed", type=int, default=0, help="pseudo-EOS of requests without ignore_eos")
    p.add_argument("--fault", action="append", default=[], metavar="NAME[=VALUE]",
                   help="inject a fault (repeatable): " + ", ".join(FAULTS))
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="append per-request server-side times (JSONL, keyed by X-Request-Id)")
    p.set_defaults(func=run, engine=engine)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("emulate", help="run an emulated vLLM or SGLang server (no GPU)",
                              description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="engine_name", metavar="{vllm,sglang}")
    sub.required = True
    for engine in ENGINES:
        _add_engine(sub, engine)


def run(args) -> int:
    from kvprobe.targets.emulator.app import Settings, serve

    d = get_dialect(args.engine)
    flags = {f.name: getattr(args, f.dest) for f in d.FLAGS.values() if f.emulated}
    model = getattr(args, "model_tag", None) or args.model
    settings = Settings(engine=args.engine, model=model, flags=flags, version=args.engine_version,
                        host=args.host, port=args.port,
                        time_model=TimeModel(args.step_ms, args.prefill_us_per_token, args.decode_us_per_seq),
                        seed=args.seed, faults=args.fault, trace=args.trace,
                        gpu_capability=getattr(args, "gpu_capability", None))
    return serve(settings)
