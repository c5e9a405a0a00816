"""Engine environments share their identical files through hard links.

Every release's environment holds the same torch 2.13.0 CPU build and most of the same packages
(2.1-2.5 GB each, 15 GB for seven). Once an environment is complete, each file pip installed under
its site-packages is replaced by a hard link to the identical file at the same path under another
complete environment's site-packages: same size, mode and owner, same SHA-256. The bytes are then
on disk once; each environment still sees its own name for every file.

Why the same relative path, not any file with the same content: a path names one distribution's
file, so a match is the same file of the same package (torch's libtorch_cpu.so in two releases), and
only files with the same path and size are read and hashed — a content index would hash every byte
of every environment to find, beyond that, only the odd license text repeated under two names.

What is linked: only files listed in the RECORD of a distribution whose INSTALLER is `pip` (what pip
wrote, and what pip alone removes or replaces). Never the venv's `bin/` or `pyvenv.cfg`, the
kvprobe marker (all outside site-packages), nor what a recipe step writes (kvprobe's plugin modules
and dist-infos say INSTALLER `kvprobe`; the torchvision stand-in is in no RECORD).

Python sources go with their bytecode, as a pair or not at all (`source_pairs`). A `.pyc` pip compiled
records its source's mtime and size, which a link of the source alone would replace with the other
environment's: the `.pyc` would go stale, and with PYTHONDONTWRITEBYTECODE set every import would
compile again. Linked together, the other environment's `.pyc` is checked first to be valid for its
own source (the header's mtime and size, or a hash-based one), and that source's inode is then the
one both environments name. Its bytes also hold the other environment's path (`co_filename`), which
the import system puts right on every load from a cache (CPython's `_bootstrap_external`
`_compile_bytecode` calls `_imp._fix_co_filename` with the source's path): tracebacks and
`inspect` name this environment's file.

Why a link is safe:
- pip never writes into an installed file: it unlinks a file before writing a new one
  (pip 23.2.1, the environments' pip: `_internal/operations/install/wheel.py` L375-390, "Unlinking the
  file allows writing of new contents"), writes RECORD and INSTALLER to a temporary file it renames
  (L661-665), and uninstalls — also the first half of `--force-reinstall` — by moving files to a
  stash (`_internal/req/req_uninstall.py` L255-273). Each acts on one environment's name, never on
  the file the other names.
- Python writes `__pycache__` by writing a temporary file and renaming it.
- kvprobe writes into an environment only while installing it, into a folder it made from nothing
  (`envs.install` removes the old one first), before the marker — before any link.
- The replacement is atomic: the link is made under a temporary name in the same folder, checked
  to be the inode that was hashed, and renamed over the file (os.replace). An engine running from
  the environment keeps the file it has open; every later open reads the same bytes.

Hard links exist within one filesystem only: an environment on another one keeps its copies
(EXDEV: nothing is linked, nothing fails).
"""

from __future__ import annotations

import csv
import errno
import hashlib
import importlib.util
import os
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Sources and their bytecode are linked in pairs only (`source_pairs`; a .pyc records its source's mtime).
NEVER_LINKED = (".py", ".pyc")


@dataclass
class Shared:
    """What linking one environment did."""

    files: int = 0  # files now a link to another environment's
    freed: int = 0  # bytes of the replaced copies that no other name held
    cross_device: int = 0  # sources on another filesystem (nothing linked to them)


def site_packages(root: Path) -> Path | None:
    found = sorted(root.glob("lib/python*/site-packages"))
    return found[0] if found else None


def recorded(site: Path) -> set[str]:
    """Paths under `site` that pip recorded there (the RECORD of each distribution whose INSTALLER is pip)."""
    out: set[str] = set()
    for info in site.glob("*.dist-info"):
        try:
            if (info / "INSTALLER").read_text().strip() != "pip":
                continue
            rows = (info / "RECORD").read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        for row in csv.reader(rows):
            rel = os.path.normpath(row[0]) if row and row[0] else ""
            if rel and not rel.startswith("..") and not os.path.isabs(rel):
                out.add(rel)
    return out


def pip_files(site: Path) -> list[str]:
    """Paths under `site` of the files pip installed there, without sources and bytecode."""
    return sorted(rel for rel in recorded(site) if not rel.endswith(NEVER_LINKED))


def source_pairs(site: Path) -> list[tuple[str, str]]:
    """(source, bytecode) under `site`: each `.py` pip installed whose `.pyc` for the environment's
    Python (its `lib/pythonX.Y`, read as CPython's cache tag) pip recorded too."""
    version = site.parent.name.removeprefix("python").replace(".", "")
    if sys.implementation.name != "cpython" or not version.isdigit():
        return []
    files = recorded(site)
    pairs = []
    for rel in sorted(files):
        if rel.endswith(".py"):
            head, name = os.path.split(rel)
            pyc = os.path.join(head, "__pycache__", f"{name[:-3]}.cpython-{version}.pyc")
            if pyc in files:
                pairs.append((rel, pyc))
    return pairs


def bytecode_fits(pyc: Path, source: os.stat_result) -> bool:
    """Is the `.pyc` valid for a source of this stat, as the import system checks it (PEP 552)? A
    timestamp one records the source's mtime and size; a hash-based one holds the source's hash,
    the same for the same bytes. Its magic must be this Python's (the header layout is)."""
    with open(pyc, "rb") as fh:
        head = fh.read(16)
    if len(head) < 16 or head[:4] != importlib.util.MAGIC_NUMBER:
        return False
    if int.from_bytes(head[4:8], "little") & 1:
        return True
    mtime, size = int.from_bytes(head[8:12], "little"), int.from_bytes(head[12:16], "little")
    return mtime == int(source.st_mtime) & 0xFFFFFFFF and size == source.st_size & 0xFFFFFFFF


def _ident(st: os.stat_result) -> tuple[int, int, int, int]:
    """One inode at one moment: a file replaced or written since has another."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _alike(a: os.stat_result, b: os.stat_result) -> bool:
    """Could be one file: a link shares size, mode and owner, so all must already agree."""
    return (stat.S_ISREG(a.st_mode) and stat.S_ISREG(b.st_mode) and a.st_size == b.st_size > 0
            and a.st_mode == b.st_mode and a.st_uid == b.st_uid and a.st_gid == b.st_gid)


class Hashes:
    """SHA-256 of each inode read, once per run (torch's libraries are compared with every environment)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int, int, int], bytes] = {}

    def of(self, path: Path, st: os.stat_result) -> bytes:
        key = _ident(st)
        if key not in self._seen:
            with open(path, "rb") as fh:
                self._seen[key] = hashlib.file_digest(fh, "sha256").digest()
        return self._seen[key]


def link_into(target: Path, sources: Sequence[Path], *, hashes: Hashes | None = None) -> Shared:
    """Replace each pip-installed file of the environment `target` by a link to the identical file in
    one of `sources` (complete environments). The caller holds `target`'s install lock."""
    hashes = hashes or Hashes()
    result = Shared()
    site = site_packages(target)
    if site is None:
        return result
    dev = os.stat(site).st_dev
    others = []
    for src in sources:
        other = site_packages(src)
        if other is None or other == site:
            continue
        try:
            same_fs = os.stat(other).st_dev == dev
        except FileNotFoundError:
            continue  # pruned meanwhile
        if same_fs:
            others.append(other)
        else:
            result.cross_device += 1
    for rel, bytecode in [(rel, None) for rel in pip_files(site)] + source_pairs(site):
        other = _link_one(site, rel, others, hashes, result, bytecode=bytecode)
        if other is not None:
            others.remove(other)  # another filesystem after all (a bind mount): its copies stay
            result.cross_device += 1
    return result


def _link_one(site: Path, rel: str, others: list[Path], hashes: Hashes, result: Shared, *,
              bytecode: str | None = None) -> Path | None:
    """Link `rel` under `site` to the identical file at the same path under the one of `others` whose
    copy has the most links; given a source's `bytecode` (`source_pairs`), the two go together or
    not at all, the other's bytecode only when it is valid for its source (the module's docstring).
    Returns the other site-packages when it turned out to be on another filesystem, for the caller
    to drop."""
    # the bytecode first: until its source follows, the import system finds it stale and compiles
    # this environment's own source (the same bytes)
    rels = (rel,) if bytecode is None else (bytecode, rel)
    try:
        mine = {r: os.lstat(site / r) for r in rels}
    except FileNotFoundError:
        return None
    found = []
    for other in others:
        try:
            theirs = {r: os.lstat(other / r) for r in rels}
        except FileNotFoundError:
            continue
        if all(_one_inode(mine[r], theirs[r]) for r in rels):
            return None  # already one file (one pair)
        if _alike(mine[rel], theirs[rel]) and (bytecode is None or _alike_bytecode(mine[bytecode], theirs[bytecode])):
            found.append((other, theirs))
    if not found:
        return None
    want = hashes.of(site / rel, mine[rel])
    # the inode with the most names first: environments converge on one copy
    for other, theirs in sorted(found, key=lambda c: -c[1][rel].st_nlink):
        try:
            if hashes.of(other / rel, theirs[rel]) != want:
                continue
            if bytecode is not None and not bytecode_fits(other / bytecode, theirs[rel]):
                continue
            for r in rels:
                if _one_inode(mine[r], theirs[r]):
                    continue
                if not _replace(site / r, mine[r], other / r, theirs[r]):
                    return None  # replaced since it was hashed
                result.files += 1
                result.freed += mine[r].st_blocks * 512 if mine[r].st_nlink == 1 else 0
        except FileNotFoundError:
            continue  # removed since it was listed: a source pruned or reinstalled
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                return other
            raise
        return None
    return None


def _one_inode(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _alike_bytecode(a: os.stat_result, b: os.stat_result) -> bool:
    """Two bytecodes of one source differ in the path they hold (their sizes too): alike in kind,
    mode and owner."""
    return (stat.S_ISREG(a.st_mode) and stat.S_ISREG(b.st_mode)
            and (a.st_mode, a.st_uid, a.st_gid) == (b.st_mode, b.st_uid, b.st_gid))


def _replace(path: Path, st: os.stat_result, source: Path, sst: os.stat_result) -> bool:
    """Rename a link to `source` over `path` when both are still the inodes that were hashed."""
    tmp = path.with_name(f".{path.name}.kvprobe-link")
    tmp.unlink(missing_ok=True)  # left by a run that was killed
    try:
        os.link(source, tmp)
        if _ident(os.lstat(tmp)) != _ident(sst) or _ident(os.lstat(path)) != _ident(st):
            return False  # one of them was replaced since it was hashed
        os.replace(tmp, path)
        return True
    finally:
        tmp.unlink(missing_ok=True)
