"""`kvprobe shadow`: engine environments for the shadow target (install, list, prune, share), and the real engines'
serving stacks on this machine (`kvprobe shadow vllm MODEL [flags]`, `kvprobe shadow sglang
--model-path MODEL [flags]`).

The real engines' serving stacks run here with only the model replaced; they live in their own
virtualenvs under the cache folder (`$KVPROBE_CACHE`, default `~/.cache/kvprobe`).
"""

from __future__ import annotations

import argparse
import sys

from kvprobe.releases import version_tuple
from kvprobe.targets.shadow import disk, envs, recipes


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("shadow", help="run the real vLLM/SGLang serving stack without a model",
                              description=__doc__)
    sub = p.add_subparsers(dest="shadow_command", metavar="{install,list,prune,share,vllm,sglang}")
    sub.required = True
    inst = sub.add_parser("install", help="make the engine environment for ENGINE==VERSION")
    inst.add_argument("spec", metavar="ENGINE==VERSION",
                      help="e.g. vllm==0.33.0 or sglang==0.5.23 (an engine alone: the release kvprobe defaults to)")
    inst.add_argument("--force", action="store_true", help="rebuild even when the environment is ready")
    inst.set_defaults(func=_install)
    lst = sub.add_parser("list", help="the versions kvprobe can install, which are installed, and the disk each takes")
    lst.set_defaults(func=_list)
    prn = sub.add_parser("prune", help="remove the engine environments not named by --keep (default: the releases "
                                       "the test suite runs), partial installs and older recipes")
    prn.add_argument("--keep", action="append", metavar="ENGINE==VERSION", default=None,
                     help="an environment to keep (repeatable); default: " + ", ".join(
                         f"{e}=={v}" for e, v in disk.SUITE_RELEASES))
    prn.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    prn.set_defaults(func=_prune)
    shr = sub.add_parser("share", help="hard-link the files the installed environments have in common (every "
                                       "install does it for itself; this does it for the ones already installed)")
    shr.set_defaults(func=_share)
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
    from kvprobe.units import format_bytes

    rows, listed = [], []
    for engine, version in sorted(recipes.RECIPES, key=lambda k: (k[0], version_tuple(k[1]))):
        env = recipes.find(engine, version)
        rows.append([f"{engine}=={version}", "installed" if env else "not installed", env.root if env else None])
        if env is not None:
            listed.append(env.root)
    for folder in disk.env_folders():  # what prune would remove: partial installs, older recipes
        if folder.path not in listed:
            what = f"{folder.engine}=={folder.version}" if folder.engine else "?"
            rows.append([what, "partial or older recipe (prune removes it)", folder.path])
    sizes = disk.footprint([root for *_, root in rows if root is not None])

    def sizes_of(root):
        return [format_bytes(n) for n in sizes[root]] if root is not None else ["-", "-"]

    base = envs.cache_root() / "envs"
    total = format_bytes(disk.disk_bytes(base)) if base.is_dir() else "0 B"
    print(render_table(["environment", "state", "own", "shared", "folder"],
                       [[what, state, *sizes_of(root), root.name if root else "-"] for what, state, root in rows],
                       title=f"engine environments under {base}", align="llrrl"), file=sys.stdout)
    print(f"own: bytes only that environment holds; shared: bytes of files hard-linked with another one "
          f"(`kvprobe shadow share`); on disk, each file once: {total}")
    return 0


def _prune(args) -> int:
    from kvprobe.units import format_bytes

    keep = [recipes.parse_spec(spec) for spec in args.keep] if args.keep else list(disk.SUITE_RELEASES)
    for engine, version in keep:
        recipes.recipe(engine, version)  # a release kvprobe cannot build is a typo, not a wish
    removed = disk.prune(keep, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for folder, size in removed:
        print(f"kvprobe shadow: {verb} {folder.path} ({format_bytes(size)})")
    total = sum(size for _, size in removed)
    print(f"kvprobe shadow: {verb} {len(removed)} environment(s), {format_bytes(total)}; kept "
          + ", ".join(f"{e}=={v}" for e, v in keep))
    return 0


def _share(args) -> int:
    import time

    from kvprobe.units import format_bytes

    t0 = time.monotonic()
    done = disk.share_all(log=_log)
    linked = [s for _, s in done if s is not None]
    print(f"kvprobe shadow: shared {sum(s.files for s in linked)} files across {len(linked)} environment(s), "
          f"{format_bytes(sum(s.freed for s in linked))} freed in {time.monotonic() - t0:.0f} s"
          + (f"; {len(done) - len(linked)} skipped (being installed)" if len(linked) < len(done) else ""))
    return 0
