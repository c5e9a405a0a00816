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

Python sources go with their bytecode, as a pair or not at all (`link_pair`). A `.pyc` pip compiled
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

# Sources and their bytecode are linked in pairs only (`link_pair`; a .pyc records its source's mtime).
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
    for rel in pip_files(site):
        other = _link_one(site / rel, [(o, o / rel) for o in others], hashes, result)
        if other is not None:
            others.remove(other)  # another filesystem after all (a bind mount): its copies stay
            result.cross_device += 1
    for source, bytecode in source_pairs(site):
        other = link_pair(site, source, bytecode, others, hashes, result)
        if other is not None:
            others.remove(other)
            result.cross_device += 1
    return result


def link_pair(site: Path, source: str, bytecode: str, others: list[Path], hashes: Hashes,
              result: Shared) -> Path | None:
    """Link a source and its bytecode under `site` to an identical source in one of `others` and the
    bytecode there that is valid for it, both or neither (the module's docstring); the source
    site-packages when it turned out to be on another filesystem, for the caller to drop."""
    try:
        st, bst = os.lstat(site / source), os.lstat(site / bytecode)
    except FileNotFoundError:
        return None
    found = []
    for other in others:
        try:
            cst, cbst = os.lstat(other / source), os.lstat(other / bytecode)
        except FileNotFoundError:
            continue
        if _ident(cst) == _ident(st) and _ident(cbst) == _ident(bst):
            return None  # already one pair
        # the bytecodes differ in the path they hold (their sizes too): alike in kind, mode and owner
        if _alike(st, cst) and stat.S_ISREG(bst.st_mode) and stat.S_ISREG(cbst.st_mode) \
                and (cbst.st_mode, cbst.st_uid, cbst.st_gid) == (bst.st_mode, bst.st_uid, bst.st_gid):
            found.append((other, cst, cbst))
    if not found:
        return None
    want = hashes.of(site / source, st)
    for other, cst, cbst in sorted(found, key=lambda c: -c[1].st_nlink):
        try:
            if hashes.of(other / source, cst) != want or not bytecode_fits(other / bytecode, cst):
                continue
            # the bytecode first: until its source follows, the import system finds it stale and
            # compiles this environment's own source (the same bytes)
            done = 0
            for rel, mine, theirs in ((bytecode, bst, cbst), (source, st, cst)):
                if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino):
                    continue
                if not _replace(site / rel, mine, other / rel, theirs):
                    return None
                done += 1
                result.freed += mine.st_blocks * 512 if mine.st_nlink == 1 else 0
            result.files += done
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                return other
            raise
        return None
    return None


def _link_one(path: Path, candidates: list[tuple[Path, Path]], hashes: Hashes, result: Shared) -> Path | None:
    """Link `path` to the identical candidate (source site-packages, file) with the most links;
    the source site-packages when it turned out to be on another filesystem, for the caller to drop."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    found = []
    for other, cand in candidates:
        try:
            cst = os.lstat(cand)
        except FileNotFoundError:
            continue
        if (cst.st_dev, cst.st_ino) == (st.st_dev, st.st_ino):
            return None  # already one file
        if _alike(st, cst):
            found.append((other, cand, cst))
    if not found:
        return None
    want = hashes.of(path, st)
    # the inode with the most names first: environments converge on one copy
    for other, cand, cst in sorted(found, key=lambda c: -c[2].st_nlink):
        try:
            if hashes.of(cand, cst) != want:
                continue
            if _replace(path, st, cand, cst):
                result.files += 1
                result.freed += st.st_blocks * 512 if st.st_nlink == 1 else 0
        except FileNotFoundError:
            continue  # removed since it was listed: a source pruned or reinstalled
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                return other
            raise
        return None
    return None


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
