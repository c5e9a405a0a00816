"""What the engine environments take on disk, and removing the ones no longer named.

Two dozen releases at 2-2.5 GB each do not fit a runner's disk beside CI's own; `kvprobe shadow
list` shows what each folder under `<cache>/envs` takes, and `kvprobe shadow prune` removes every
folder there that is not the complete environment of a release it is told to keep (by default the
releases the test suite runs: each engine's default and the router), including partial installs
and the environments of older recipes. A folder whose install lock is held (an install running)
is left alone.

`kvprobe shadow share` (and every install, as its last step) makes the complete environments share
their identical files by hard links (`kvprobe.targets.shadow.share`); `list` then shows per
environment the bytes only it holds and the bytes it shares, and the whole folder counted once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvprobe.errors import ConfigError
from kvprobe.releases import SGLANG_DEFAULT_VERSION, VLLM_DEFAULT_VERSION
from kvprobe.targets.shadow import envs, share
from kvprobe.targets.shadow.vllm import env as vllm_env
from kvprobe.units import format_bytes

# What `make test` installs (vLLM 0.18.1 for tests/shadow/test_vllm_release_pair.py): pruning without
# --keep leaves these.
SUITE_RELEASES = (("vllm", VLLM_DEFAULT_VERSION), ("vllm", vllm_env.VERSION), ("sglang", SGLANG_DEFAULT_VERSION),
                  ("sglang-router", "0.3.2"))


def _file_stats(root: Path):
    """The lstat of every file under `root`, skipping one removed while the folder is walked."""
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                yield os.lstat(os.path.join(folder, name))
            except OSError:
                continue


def disk_bytes(root: Path) -> int:
    """Bytes the folder holds on disk, each hard-linked file once (environments share their identical
    files: `kvprobe shadow share`)."""
    blocks = {(st.st_dev, st.st_ino): st.st_blocks * 512 for st in _file_stats(root)}
    return sum(blocks.values())


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


@contextlib.contextmanager
def _try_lock(path: Path):
    """Hold the environment's install lock if no one else does; yields whether it is held."""
    with open(path.with_name(path.name + ".lock"), "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _installed(path: Path) -> bool:
    """The install in this folder completed: its marker (written last) names the recipe digest the
    folder is named after. Whether this checkout still has that recipe does not matter here: a
    release another branch installed shares its files as well."""
    mark = envs._marker(envs.EngineEnv("", "", path))
    digest = str(mark.get("digest", "")) if mark else ""
    return bool(digest) and path.name.endswith("-" + digest) and (path / "bin" / "python").exists()


def _shareable(but: Path | None = None) -> list[Path]:
    """The complete environments no install is touching (a source must not change while it is read)."""
    base = envs.cache_root() / "envs"
    folders = sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
    return [p for p in folders if p != but and _installed(p) and not _lock_held(p)]


def share_after_install(root: Path, *, log: Callable[[str], None]) -> None:
    """An install's last step (its lock held): link the new environment to the others. It is complete
    already; a failure here leaves it unshared, never broken, so it is reported, not raised."""
    try:
        done = share.link_into(root, _shareable(but=root))
    except OSError as exc:
        log(f"kvprobe shadow: could not share files with the other environments ({exc}); "
            "`kvprobe shadow share` tries again")
        return
    log(f"kvprobe shadow: {done.files} files are now links to identical ones in other environments "
        f"({format_bytes(done.freed)} freed)" + (f"; {done.cross_device} on another filesystem keep their own"
                                                 if done.cross_device else ""))


def share_all(*, log: Callable[[str], None] = print) -> list[tuple[Path, share.Shared | None]]:
    """Link every complete environment to the others; (folder, what was linked, or None when its
    lock was held and it was skipped)."""
    hashes = share.Hashes()
    done: list[tuple[Path, share.Shared | None]] = []
    for root in _shareable():
        with _try_lock(root) as mine:
            if not mine:
                log(f"kvprobe shadow: {root.name} is being installed: skipped")
                done.append((root, None))
                continue
            t0 = time.monotonic()
            shared = share.link_into(root, _shareable(but=root), hashes=hashes)
            done.append((root, shared))
            log(f"kvprobe shadow: {root.name}: {shared.files} files linked, {format_bytes(shared.freed)} freed "
                f"({time.monotonic() - t0:.0f} s)" + (f"; {shared.cross_device} environments on another "
                                                      "filesystem keep their copies" if shared.cross_device else ""))
    return done


def footprint(roots: list[Path]) -> dict[Path, tuple[int, int]]:
    """Per folder (bytes only it holds, bytes of files it shares with a folder elsewhere): a file is
    its own when every link to it is inside the folder."""
    out = {}
    for root in roots:
        names: Counter[tuple[int, int]] = Counter()
        blocks: dict[tuple[int, int], tuple[int, int]] = {}
        for st in _file_stats(root):
            key = (st.st_dev, st.st_ino)
            names[key] += 1
            blocks[key] = (st.st_blocks * 512, st.st_nlink)
        own = sum(size for key, (size, links) in blocks.items() if names[key] >= links)
        out[root] = (own, sum(size for size, _ in blocks.values()) - own)
    return out


# An install's last step, registered rather than called from envs: this module lists the environments,
# so it imports envs, and envs must not import it back (tests/test_house.py: no import cycles).
envs.AFTER_INSTALL.append(share_after_install)
