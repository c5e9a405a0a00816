"""`kvprobe shadow`: engine environments for the shadow target (install, list), and the real engines'
serving stacks on this machine (`kvprobe shadow vllm MODEL [flags]`, `kvprobe shadow sglang
--model-path MODEL [flags]`).

The real engines' serving stacks run here with only the model replaced; they live in their own
virtualenvs under the cache folder (`$KVPROBE_CACHE`, default `~/.cache/kvprobe`).
"""

from __future__ import annotations

import argparse
import sys

from kvprobe.releases import version_tuple
from kvprobe.targets.shadow import envs, recipes


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("shadow", help="run the real vLLM/SGLang serving stack without a model",
                              description=__doc__)
    sub = p.add_subparsers(dest="shadow_command", metavar="{install,list,vllm,sglang}")
    sub.required = True
    inst = sub.add_parser("install", help="make the engine environment for ENGINE==VERSION")
    inst.add_argument("spec", metavar="ENGINE==VERSION",
                      help="e.g. vllm==0.33.0 or sglang==0.5.23 (an engine alone: its newest known version)")
    inst.add_argument("--force", action="store_true", help="rebuild even when the environment is ready")
    inst.set_defaults(func=_install)
    lst = sub.add_parser("list", help="the versions kvprobe can install, and which are installed")
    lst.set_defaults(func=_list)
    from kvprobe.cli import shadow_sglang as sglang_cli
    from kvprobe.cli import shadow_vllm as vllm_cli

    vllm_cli.add_parser(sub)
    sglang_cli.add_parser(sub)
    return p


def _log(line: str) -> None:
    print(line, flush=True)


def _install(args) -> int:
    engine, version = recipes.parse_spec(args.spec)
    recipes.recipe(engine, version)  # an unknown version fails before anything is created
    recipes.install(engine, version, log=_log, force=args.force)
    return 0


def _list(args) -> int:
    from kvprobe.tables import render_table

    rows = [[f"{engine}=={version}", "installed" if recipes.find(engine, version) else "not installed"]
            for engine, version in sorted(recipes.RECIPES, key=lambda k: (k[0], version_tuple(k[1])))]
    print(render_table(["environment", "state"], rows, title=f"engine environments under {envs.cache_root() / 'envs'}",
                       align="ll"), file=sys.stdout)
    return 0
