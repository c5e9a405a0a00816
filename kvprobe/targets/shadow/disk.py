"""What the engine environments take on disk, and removing the ones no longer named.

Two dozen releases at 2-2.5 GB each do not fit a runner's disk beside CI's own; `kvprobe shadow
list` shows what each folder under `<cache>/envs` takes, and `kvprobe shadow prune` removes every
folder there that is not the complete environment of a release it is told to keep (by default the
releases the test suite runs: each engine's default and the router), including partial installs
and the environments of older recipes. A folder whose install lock is held (an install running)
is left alone.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvprobe.errors import ConfigError
from kvprobe.releases import SGLANG_DEFAULT_VERSION, VLLM_DEFAULT_VERSION
from kvprobe.targets.shadow import envs
from kvprobe.targets.shadow.vllm import env as vllm_env

# What `make test` installs (vLLM 0.18.1 for tests/shadow/test_vllm_release_pair.py): pruning without
# --keep leaves these.
SUITE_RELEASES = (("vllm", VLLM_DEFAULT_VERSION), ("vllm", vllm_env.VERSION), ("sglang", SGLANG_DEFAULT_VERSION),
                  ("sglang-router", "0.3.2"))


def disk_bytes(root: Path) -> int:
    """Bytes the folder holds on disk, each hard-linked file once (environments built from one
    package cache by a linking installer share their files)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue  # removed while walking
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


@dataclass(frozen=True)
class EnvFolder:
    path: Path
    engine: str | None  # from its marker; None for a partial install
    version: str | None
    complete: bool  # the marker of the current recipe of that release is in it


def env_folders() -> list[EnvFolder]:
    """Every environment folder under the cache, complete or not."""
    base = envs.cache_root() / "envs"
    if not base.is_dir():
        return []
    out = []
    for path in sorted(p for p in base.iterdir() if p.is_dir()):
        engine = version = None
        complete = False
        mark = envs._marker(envs.EngineEnv("", "", path))
        if mark:
            engine, version = mark.get("engine"), mark.get("version")
            found = _current(engine, version)
            complete = found is not None and found.root == path
        out.append(EnvFolder(path, engine, version, complete))
    return out


def _current(engine: str | None, version: str | None):
    try:
        return envs.find(engine, version) if engine and version else None
    except ConfigError:  # a release whose recipe kvprobe no longer has: not current
        return None


def _lock_held(path: Path) -> bool:
    lock = path.with_name(path.name + ".lock")
    if not lock.exists():
        return False
    with open(lock, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def prune(keep: list[tuple[str, str]], *, dry_run: bool = False) -> list[tuple[EnvFolder, int]]:
    """Remove every environment folder but the complete ones of `keep`; (folder, bytes freed) for
    each removed (or, with dry_run, each that would be)."""
    kept = {(e, v) for e, v in keep}
    removed = []
    for folder in env_folders():
        if folder.complete and (folder.engine, folder.version) in kept:
            continue
        if _lock_held(folder.path):
            continue
        size = disk_bytes(folder.path)
        if not dry_run:
            shutil.rmtree(folder.path, ignore_errors=True)
            folder.path.with_name(folder.path.name + ".lock").unlink(missing_ok=True)
        removed.append((folder, size))
    return removed
