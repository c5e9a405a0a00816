"""`kvprobe ledger`: print the capacity ledger of one engine configuration (theory only, no GPU).

The engine's flags are options under their real names, generated from the dialect modules' flag
tables (`kvprobe/engines/vllm.py`, `sglang.py` FLAGS): the same names, values and meaning as the
`flags:` of an expectation, validated by the same code and mapped to the ledger by the same table
(`Flag.ledger`, `kvprobe.spec.flags.flag_ledger_kwargs`). When the engine would refuse to start, every
table is still printed, then the refusal as a finding, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from kvprobe.cli.common import GPU_FREE_MEMORY_HELP, add_gpu_arguments, gpu_from_args
from kvprobe.errors import ConfigError
from kvprobe.releases import ENGINES, SGLANG_DEFAULT_VERSION, VLLM_DEFAULT_VERSION
from kvprobe.theory.model.mxfp4 import GPU_ARCHS
from kvprobe.units import parse_bytes, parse_count

DESCRIPTION = """\
Print the capacity ledger of one engine configuration: the KV pool the engine would build and,
with --prompt-tokens and --output-tokens, how many requests it admits at once (theory only, no GPU).

The engine's own flags are options under their real names, with the same values and meaning as
the `flags:` of an expectation. When the engine would refuse to start, every table is still
printed, then the refusal as a finding, and the exit code is 1 (bad input: 2)."""
# Flags an expectation may not set either: the launcher owns them (kvprobe.spec.flags.MANAGED_FLAGS).
_NOT_OPTIONS = ("served-model-name", "api-key")
# The workload: not engine flags. (name, LedgerInputs field, help)
REQUEST_OPTIONS = (
    ("prompt-tokens", "prompt_tokens", "P: prompt tokens of every request"),
    ("output-tokens", "output_tokens", "O: output tokens of every request"),
    ("users", "users", "N users, each sending its next request when one ends: the steady state at N"),
    ("shared-prefix-tokens", "shared_prefix_tokens",
     "K: the first K prompt tokens are the same in every request (a system prompt)"),
)
# kvprobe's short spellings of the parallel flags, one per engine's real name.
_DEGREE = {"tp": "tensor", "pp": "pipeline", "dp": "data"}
PARALLEL = {"tp": ("tensor-parallel-size", "tp-size"), "pp": ("pipeline-parallel-size", "pp-size"),
            "dp": ("data-parallel-size", "dp-size")}


def _dialects():
    from kvprobe.engines import get_dialect

    return {name: get_dialect(name) for name in ENGINES}


def engine_flags() -> dict[str, tuple[object, tuple[str, ...]]]:
    """Every modelled flag of either engine: name -> (Flag, engines that have it)."""
    out: dict[str, tuple[object, tuple[str, ...]]] = {}
    for engine, d in _dialects().items():
        for name, flag in d.FLAGS.items():
            if name in _NOT_OPTIONS:
                continue
            first, engines = out.get(name, (flag, ()))
            out[name] = (first, (*engines, engine))
    return out


def _help(flag, engines: tuple[str, ...]) -> str:
    who = "" if len(engines) == len(ENGINES) else f"{engines[0]}: "
    unread = "" if flag.ledger else " (not read by the ledger)"
    return f"{who}{flag.help}{unread}"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ledger", help="predict the KV pool and admission limit from config.json, GPU memory and flags",
        description=DESCRIPTION, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, choices=ENGINES)
    from kvprobe.theory.model.geometry import list_presets

    p.add_argument("--model", required=True,
                   help="a path to a config.json (or its dir), or a packaged preset: " + ", ".join(list_presets()))
    p.add_argument("--engine-version",
                   help=f"engine version (defaults: vLLM {VLLM_DEFAULT_VERSION}, SGLang {SGLANG_DEFAULT_VERSION})")
    p.add_argument("--policy", help="admission policy (default: the engine version's; required for a version "
                                    "kvprobe has no facts for)")
    add_gpu_arguments(p)
    p.add_argument("--gpu-free-memory", metavar="SIZE", help=GPU_FREE_MEMORY_HELP)
    p.add_argument("--gpu-arch", choices=GPU_ARCHS,
                   help="GPU family, for kernel-padded weights (MXFP4 experts): sm90 Hopper (default), "
                        "sm100 Blackwell, sm89 Ada (L4, L40S, RTX 4090; vLLM only), and vLLM's Gated DeltaNet prefill "
                        "kernel; default: the family of --gpu")
    p.add_argument("--estimate", action="append", default=[], metavar="NAME=BYTES",
                   help="override a vLLM non-KV estimate: activation_bytes, cudagraph_bytes, other_bytes")
    p.add_argument("--json", action="store_true", help="print the ledger as JSON (a refusal under `startup`)")
    for name, _, help_text in REQUEST_OPTIONS:
        p.add_argument(f"--{name}", help=help_text)
    for short, names in PARALLEL.items():
        p.add_argument(f"--{short}", help=f"the {_DEGREE[short]} parallel degree ({' / '.join(names)})")
    fleet = p.add_argument_group("fleet",
                                 "replicas of this configuration behind sglang-router")
    fleet.add_argument("--replicas", type=int, help="number of replicas: adds the fleet's lines to the ledger")
    fleet.add_argument("--router-policy", default="round_robin",
                       help="sglang-router 0.3.2 policy: round_robin, random, power_of_two, cache_aware")
    add_engine_flags(p)
    p.set_defaults(func=run)
    return p


def add_engine_flags(p: argparse.ArgumentParser, *, others: bool = True,
                     description: str = "the engine's own flags, as an expectation's `flags:` writes them") -> None:
    """Both engines' flags as options under their real names (`kvprobe ledger`, and `kvprobe probe
    --url` for what the engine does not publish); `others`: also the real flags kvprobe does not model."""
    flags = p.add_argument_group("engine flags", description)
    known = engine_flags()
    # An alias that is another flag's own name (SGLang's --tensor-parallel-size, vLLM's flag) is
    # one option; given_flags resolves it with the chosen engine's aliases.
    aliases = {a: t for d in _dialects().values() for a, t in d.FLAG_ALIASES.items()
               if a not in known and a not in PARALLEL}
    for name, (flag, engines) in known.items():
        names = [f"--{name}", *(f"--{a}" for a, t in aliases.items() if t == name)]
        dest = f"flag:{name}"
        if flag.value_kind == "bool":
            action = argparse.BooleanOptionalAction if flag.negatable else "store_true"
            flags.add_argument(*names, dest=dest, action=action, default=None, help=_help(flag, engines))
        else:
            flags.add_argument(*names, dest=dest, metavar=flag.value_kind.upper(), help=_help(flag, engines))
    if not others:
        return
    others_ = sorted({f for d in _dialects().values() for f in d.OTHER_FLAGS} - set(known) - set(aliases))
    unread = p.add_argument_group("other engine flags", textwrap.fill(
        "real flags kvprobe does not model, accepted as in an expectation (a launched engine gets them) and "
        "not read by the ledger: " + ", ".join(f"--{n}" for n in others_), 100, break_on_hyphens=False))
    for name in others_:
        unread.add_argument(f"--{name}", dest=f"other:{name}", nargs="?", const=True, default=None,
                            metavar="VALUE", help=argparse.SUPPRESS)


def unread_flags(args: argparse.Namespace) -> list[str]:
    """Flags given that do not change the ledger (said once on stderr, so nobody expects them to)."""
    from kvprobe.engines import get_dialect

    dialect = get_dialect(args.engine)
    out = []
    for key, raw in vars(args).items():
        kind, _, name = key.partition(":")
        if raw is None or kind not in ("flag", "other"):
            continue
        name = dialect.FLAG_ALIASES.get(name, name)
        flag = dialect.FLAGS.get(name)
        if kind == "other" or flag is None or flag.ledger is None:
            out.append(f"--{name}")
    return out


def given_flags(args: argparse.Namespace) -> dict[str, object]:
    """The engine flags given on the command line, validated as an expectation's are."""
    from kvprobe.engines import get_dialect
    from kvprobe.spec.flags import parse_flag
    from kvprobe.spec.node import Node

    known = engine_flags()
    dialect = get_dialect(args.engine)
    out: dict[str, object] = {}
    for key, raw in vars(args).items():
        if not key.startswith("flag:") or raw is None:
            continue
        name = dialect.FLAG_ALIASES.get(key[len("flag:"):], key[len("flag:"):])
        flag, engines = known[name]
        if args.engine not in engines:
            raise ConfigError(f"expected a {args.engine} flag (--{name} is a {engines[0]} flag; "
                              f"`kvprobe {getattr(args, 'command', 'ledger')} --help` lists both)", key=f"--{name}")
        flag = dialect.FLAGS[name]
        if flag.value_kind == "bool":
            out[name] = bool(raw)
            continue
        out[name] = parse_flag(Node(_typed(raw, flag.value_kind), "", f"--{name}"), flag.value_kind, flag.lo)
    for short, names in PARALLEL.items():
        text = getattr(args, short, None)
        if text is not None:
            name = names[ENGINES.index(args.engine)]
            if name in out:
                raise ConfigError(f"one of --{short} or --{name}", key=f"--{short}")
            out[name] = parse_count(text, key=f"--{short}")
    return out


def _typed(raw: str, kind: str) -> object:
    """A command-line string as the YAML reader would have typed it, for the same validation."""
    text = raw.strip()
    try:
        if kind == "int" or (kind == "len" and text == "-1"):
            return int(text)
        if kind in ("float", "frac"):
            return float(text)
    except ValueError:
        pass  # parse_flag names what was expected
    return text


def inputs_from_args(args: argparse.Namespace, gpu=None):
    from kvprobe.engines import is_known_version, unknown_version_message
    from kvprobe.spec.flags import flag_ledger_kwargs
    from kvprobe.spec.gpus import gpu_free_memory
    from kvprobe.theory.admission import POLICIES
    from kvprobe.theory.ledger.inputs import LedgerInputs

    if args.policy is not None and args.policy not in POLICIES:
        raise ConfigError(f"expected one of {', '.join(POLICIES)}, got {args.policy!r}", key="--policy")
    if args.engine_version and args.policy is None and not is_known_version(args.engine, args.engine_version):
        raise ConfigError("expected "
                          f"{unknown_version_message(args.engine, args.engine_version, policy_hint='--policy')}",
                          key="--engine-version")
    request = {}
    for name, field, _ in REQUEST_OPTIONS:
        text = getattr(args, name.replace("-", "_"))
        if text is not None:
            request[field] = parse_count(text, key=f"--{name}")
    estimates = {}
    for item in args.estimate:
        name, sep, size = item.partition("=")
        if not sep:
            raise ConfigError(f"expected NAME=BYTES, got {item!r}", key="--estimate")
        estimates[name.strip()] = parse_bytes(size, key=f"--estimate {name.strip()}")
    return LedgerInputs(
        engine=args.engine, model=args.model, engine_version=args.engine_version, policy=args.policy,
        gpu_memory_bytes=None if gpu is None else gpu.total_bytes,
        gpu_free_memory_bytes=gpu_free_memory(getattr(args, "gpu_free_memory", None), total=gpu),
        gpu_name=None if gpu is None or gpu.gpu is None else gpu.gpu.smi_name,
        gpu_arch=args.gpu_arch or (None if gpu is None or gpu.gpu is None else gpu.gpu.arch), estimates=estimates,
        gpu_sms=None if gpu is None or gpu.gpu is None else gpu.gpu.sms,
        # an explicit --gpu-arch names the family the card's capability would (kv_cache_spec.card_capability)
        gpu_capability=None if args.gpu_arch or gpu is None or gpu.gpu is None else gpu.gpu.capability,
        **request,
        **flag_ledger_kwargs(args.engine, given_flags(args), args.engine_version))


def _fleet(ledger, args: argparse.Namespace):
    """One replica's ledger and the fleet's lines (needs the request shape: the admission limit)."""
    from kvprobe.theory.fleet import POLICIES
    from kvprobe.theory.ledger.fleet import fleet_ledger

    if args.replicas < 1:
        raise ConfigError(f"expected a number of replicas >= 1, got {args.replicas}", key="--replicas")
    if args.router_policy not in POLICIES:
        raise ConfigError(f"expected one of {', '.join(POLICIES)}, got {args.router_policy!r}", key="--router-policy")
    if ledger.admission is None:
        raise ConfigError("expected --prompt-tokens and --output-tokens with --replicas (the fleet's figures "
                          "scale one replica's admission limit)", key="--replicas")
    return fleet_ledger(ledger, replicas=args.replicas, policy=args.router_policy,
                        prompt_tokens=ledger.inputs.prompt_tokens, output_tokens=ledger.inputs.output_tokens)


def run(args: argparse.Namespace) -> int:
    from kvprobe.report.claim import ledger_claim_lines, ledger_claim_text, ledger_figures
    from kvprobe.report.console import wrap_line
    from kvprobe.theory.ledger.build import build_ledger
    from kvprobe.theory.ledger.text import render_ledger

    gpu = gpu_from_args(args)
    ledger = build_ledger(inputs_from_args(args, gpu), explain_refusal=True)
    if getattr(args, "replicas", None) is not None:
        ledger = _fleet(ledger, args)
    unread = unread_flags(args)
    if unread:
        print(f"kvprobe ledger: note: {', '.join(unread)} not read by the ledger (the engine's own behaviour "
              "there is not modelled)", file=sys.stderr)
    replica = getattr(ledger, "replica", ledger)  # a fleet's figures are its replica's
    if args.json:
        out = ledger.to_dict()
        figures = ledger_figures(replica)
        out["engine_figures"] = None if replica.refusal is not None else {
            "lines": ledger_claim_lines(replica), **(figures.to_dict() if figures else {})}
        print(json.dumps(out, indent=2))
    else:
        if gpu is not None:
            print(f"{gpu.said}\n")
        print(render_ledger(ledger))
        if claim := ledger_claim_text(replica):
            *engine_lines, last = claim.splitlines()  # the engine's lines verbatim, whatever their width
            print("\n" + "\n".join(engine_lines + [wrap_line(last) if ledger_figures(replica) else last]))
    return 1 if ledger.startup["refused"] else 0
