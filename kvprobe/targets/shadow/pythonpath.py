"""How kvprobe's code reaches an engine's processes: a folder on their PYTHONPATH holding only kvprobe."""

from __future__ import annotations

import hashlib
from pathlib import Path

import kvprobe
from kvprobe.targets.shadow.envs import cache_root


def kvprobe_pythonpath() -> Path:
    """A folder holding only a link to this kvprobe package: on the engine's PYTHONPATH it makes
    kvprobe's worker/plugin importable in the engine's processes (their children inherit it) without
    exposing kvprobe's own site-packages to the engine environment, and without tying the shared
    environment to one checkout of kvprobe."""
    package = Path(kvprobe.__file__).resolve().parent
    folder = cache_root() / "pythonpath" / hashlib.sha256(str(package).encode()).hexdigest()[:12]
    link = folder / "kvprobe"
    if not (link.is_symlink() and link.resolve() == package):
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".kvprobe.{id(folder)}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(package, target_is_directory=True)
        tmp.replace(link)  # atomic: a concurrent launch sees the old or the new link
    return folder
