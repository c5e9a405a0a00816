"""`kvprobe probe EXPECTATION.yaml [--url URL] [--artifacts DIR]` — one probe from the console;
`kvprobe probe --url URL --engine vllm|sglang --prompt-tokens P --output-tokens O` — a probe of a running
engine with no YAML: what the engine publishes is the configuration (kvprobe.spec.attach).

Exit codes: 0 every probe passed; 1 a check failed (the engine disagrees with the expectation);
2 bad input (one line naming the file and key); 3 a probe could not measure (engine unreachable
or dead, client saturated, no metrics, too few deep levels) and none failed; 130 interrupted.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from kvprobe.cli.common import add_gpu_arguments, gpu_from_args
from kvprobe.errors import ConfigError
from kvprobe.releases import ENGINES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "probe", help="run the probe(s) of an expectation file, or of a running engine "
        "(--url, --engine, --prompt-tokens, --output-tokens), and judge them",
        epilog="exit codes: 0 passed, 1 a check failed, 2 bad input, 3 could not measure, 130 interrupted")
    p.add_argument("expectation", nargs="?", help="an expectations/*.yaml file (omit it to probe --url as it runs)")
    p.add_argument("--url", help="attach to this running engine instead of launching one")
    p.add_argument("--artifacts", default="artifacts", help="directory for results, records, metrics and the plot")
    p.add_argument("--name", help="run only the expectation with this name")
    p.add_argument("--profile", help="a load profile name or path replacing the expectation's")
    p.add_argument("--budget", type=float, help="time budget per probe in seconds")
    p.add_argument("--tolerance", action="append", default=[], metavar="NAME=VALUE",
                   help="override one tolerance, e.g. rejection_point=2 (repeatable)")
    p.add_argument("--engine-command",
                   help="the engine command to launch instead of `vllm serve` / `python -m sglang.launch_server` "
                   "(shell quoting rules)")
    bare = p.add_argument_group("without an expectation file (--url)", "the engine's configuration is what it "
                                "publishes; the model's geometry a preset matching its served id, or --model-config")
    bare.add_argument("--engine", choices=ENGINES, help="the engine serving at --url")
    bare.add_argument("--prompt-tokens", type=int, metavar="P", help="prompt tokens of every request")
    bare.add_argument("--output-tokens", type=int, metavar="O", help="output tokens of every request")
    bare.add_argument("--model", metavar="ID", help="the served model id to send (default: the one it serves)")
    bare.add_argument("--model-config", metavar="PATH", help="the model's config.json (when no preset matches)")
    bare.add_argument("--engine-version", help="when the engine does not publish its version")
    bare.add_argument("--policy", help="the admission policy, for a version kvprobe has no facts for")
    add_gpu_arguments(bare, memory_help="the memory of one GPU, with its unit (79.2GiB, 85GB): the ledger then "
                      "sizes the pool itself and reported_capacity compares; without it (or --gpu) the engine's own "
                      "pool is taken")
    bare.add_argument("--api-key-env", metavar="NAME", help="environment variable holding the engine's API key")
    from kvprobe.cli.ledger import add_engine_flags

    # What the engine does not publish (vLLM's --max-num-seqs outside dev mode), declared under the
    # flag's real name; a published value wins and a different declared one is printed as a contradiction.
    add_engine_flags(p, others=False, description="with --url: what the running engine was started with and does "
                     "not publish (vLLM's --max-num-seqs outside dev mode); a value it publishes wins")
    p.set_defaults(func=run)


_BARE_OPTIONS = ("engine", "prompt_tokens", "output_tokens", "model", "model_config", "engine_version", "policy",
                 "gpu", "gpu_memory", "api_key_env")


def expectation_from_engine(args):
    """The no-YAML probe: attach, read what the engine publishes, build the Expectation from it."""
    return _attached(args)[0]


def _attached(args):
    """(the probe's expectation, the ledger's): the ledger's has the engine's value wherever a
    declared flag contradicts it; the probe's keeps the declared one, for its discovery to say."""
    from kvprobe.spec.attach import attached_expectation
    from kvprobe.targets.launch import Target

    missing = [f"--{n}" for n in ("url", "engine", "prompt_tokens", "output_tokens") if getattr(args, n) is None]
    if missing:
        raise ConfigError(f"expected an expectation file, or {', '.join(missing).replace('_', '-')} to probe a "
                          "running engine")  # the console prefixes "kvprobe probe: error:"
    if args.policy is not None:
        from kvprobe.theory.admission import POLICIES

        if args.policy not in POLICIES:
            raise ConfigError(f"expected one of {', '.join(POLICIES)}, got {args.policy!r}", key="--policy")
    from kvprobe.observe.discovery import discover
    from kvprobe.targets.open import check_attached

    check_url(args.url)
    from kvprobe.cli.ledger import given_flags

    declared = given_flags(args)
    gpu = gpu_from_args(args)
    check_attached(args.url, args.engine, args.api_key_env, key_option="--api-key-env", engine_option="--engine")
    if gpu is not None:
        print(gpu.said, flush=True)
    target = Target.attach(args.url, engine=args.engine, api_key_env=args.api_key_env)
    facts = target.facts()
    exp = attached_expectation(
        url=args.url, engine=args.engine, facts=facts, prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens, model=args.model, model_config=args.model_config,
        version=args.engine_version, policy=args.policy, api_key_env=args.api_key_env, profile=args.profile,
        gpu_memory_bytes=None if gpu is None else gpu.total_bytes, flags=declared,
        log=lambda line: print(line, flush=True))
    # The configuration is the engine's: its flags (and its pool, without a declared GPU) make the
    # ledger, with the declared flags for what it does not publish; the probe reads them again and
    # says which came from where. A declared value the engine contradicts is kept in the probe's
    # expectation so that the probe's discovery prints the contradiction and predicts from the engine's.
    merged = discover(exp, facts).expectation(exp)
    return dataclasses.replace(merged, flags={**merged.flags, **declared}), merged


def check_url(url: str | None) -> None:
    """An engine's URL names its scheme: `localhost:8000` is refused here (exit 2), not at attach."""
    import urllib.parse

    if url is None:
        return
    parts = urllib.parse.urlsplit(url if "://" in url else "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        from kvprobe.observe.http import redact_url

        shown = redact_url(url) if "://" in url else "***@" + url.rsplit("@", 1)[1] if "@" in url else url
        hint = f": write http://{url}" if "://" not in url and "@" not in url else ""
        raise ConfigError(f"expected an http:// or https:// URL with a host, got {shown!r}{hint}", key="--url")


def _check_bare_options(args) -> None:
    given = [f"--{n.replace('_', '-')}" for n in _BARE_OPTIONS if getattr(args, n) is not None]
    given += [f"--{k.partition(':')[2]}" for k, v in vars(args).items() if k.startswith("flag:") and v is not None]
    if args.expectation is not None and given:
        raise ConfigError(f"expected these options only without an expectation file (the file says them): "
                          f"{', '.join(given)}")


def run(args) -> int:
    from kvprobe.procgroup import sigterm_as_interrupt

    with sigterm_as_interrupt():  # the finally below stops everything it started, on SIGTERM too
        return _run(args)


def _run(args) -> int:
    from kvprobe.errors import KvprobeError
    from kvprobe.probe.run import ProbeOptions, predict, run_probe
    from kvprobe.report import console as report
    from kvprobe.spec.expectation import load_expectations, tolerance_overrides
    from kvprobe.spec.launch import split_command
    from kvprobe.tables import render_table
    from kvprobe.theory.ledger.text import render_ledger

    if args.budget is not None and not args.budget > 0:
        raise ConfigError(f"expected a time budget in seconds > 0, got {args.budget:g}", key="--budget")
    _check_bare_options(args)
    if args.expectation is not None:
        check_url(args.url)  # without a file, expectation_from_engine checks it with the other options
    tolerances = tolerance_overrides(args.tolerance)
    ledger_exp = {}  # the no-YAML probe: the ledger printed first is the engine-wins one
    if args.expectation is None:
        probe_exp, engine_wins = _attached(args)
        ledger_exp[probe_exp.name] = engine_wins
        expectations = [probe_exp]
    else:
        expectations = load_expectations(args.expectation)
    if args.name:
        expectations = [e for e in expectations if e.name == args.name]
        if not expectations:
            raise ConfigError(f"no expectation named {args.name!r}", file=args.expectation, key="name")
    for exp in expectations if args.expectation is not None else ():
        url = None if exp.target.fleet else args.url or exp.target.url
        if url:  # an attached engine: its API key and its engine before the ledger and the probe
            from kvprobe.targets.open import check_attached

            check_attached(url, exp.engine, exp.target.api_key_env, file=exp.path)
    root = Path(args.artifacts)
    results = []
    for exp in expectations:
        options = ProbeOptions(
            artifacts_dir=root / exp.name if len(expectations) > 1 else root,
            url=args.url,
            engine_command=split_command(args.engine_command) if args.engine_command else None,
            tolerances=tolerances,
            budget_seconds=args.budget,
            profile=args.profile if args.expectation is not None else None,  # bare: already in the expectation
            log=lambda line: print(line, flush=True),
        )
        try:
            # the theory first: a person reads it while the ramp runs
            print(render_ledger(predict(ledger_exp.get(exp.name, exp))) + "\n", flush=True)
        except KvprobeError:
            pass  # run_probe reports the same error as the probe's verdict
        result = run_probe(exp, options)
        if result.levels:
            print(report.levels_table(result))
            if getattr(result, "fleet", None):
                from kvprobe.report.fleet import replica_table

                print(replica_table(result))
        print(report.verdict_table(result))
        print(report.closing_line(result, options.artifacts_dir))
        results.append(result)
    if len(results) > 1:
        print(report.wrap_last_column(render_table(report.SUMMARY_HEADERS, [report.summary_row(r) for r in results],
                                                   title="kvprobe summary")))
    sys.stdout.flush()
    return exit_code([r.status for r in results])


EXIT_CODES = {"passed": 0, "failed": 1, "error": 3}


def exit_code(statuses: list[str]) -> int:
    """A failed check wins (the engine disagrees, whatever else happened), then a probe that could
    not measure; 0 only when every probe passed."""
    for status in ("failed", "error"):
        if status in statuses:
            return EXIT_CODES[status]
    return EXIT_CODES["passed"] if statuses else EXIT_CODES["error"]
