"""Engine environments: a virtualenv per engine version, made on demand under a cache folder.

A shadow target runs the engine's real serving stack, so it needs that engine installed — but
never into kvprobe's own environment (vLLM and SGLang pin torch, transformers and each other's
dependencies differently) and never inside the repository. Each `(engine, version)` has a recipe:
a pinned CPU-only package list installed with `--no-deps` (letting pip resolve the engines'
dependencies pulls CUDA wheels of several GB), plus the small steps an engine needs on a CPU.
The pins were found by import-error iteration on this kind of machine.

An environment is complete only when its marker file exists; the marker is written last, after the
engine imported with the expected version, and records the recipe's digest, so a changed pin list
reinstalls. Installs of one environment are serialised by a lock file, so two test sessions never
build it at once.

The registry below holds the vLLM recipe (pins only); recipes written in their own modules (the
SGLang plugin's entry point, the fleet's router) register themselves there when imported, and
`kvprobe.targets.shadow.recipes` imports them all: a caller that looks up any recipe by name goes
through it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from kvprobe.engines import get_dialect
from kvprobe.errors import ConfigError, KvprobeError
from kvprobe.procgroup import stop_group
from kvprobe.releases import DEFAULT_VERSIONS, ENGINES, VLLM, VLLM_DEFAULT_VERSION, version_tuple

CACHE_ENV = "KVPROBE_CACHE"
MARKER = "kvprobe-env.json"
INSTALL_TIMEOUT = 45 * 60.0  # seconds for the whole install; a cold pip cache takes 2-4 min here
LOCK_TIMEOUT = INSTALL_TIMEOUT + 60.0


class EnvError(KvprobeError):
    """An engine environment could not be made or does not work."""

    exit_code = 3


def cache_root() -> Path:
    """`$KVPROBE_CACHE`, else `~/.cache/kvprobe` (engine environments and model folders live here)."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvprobe"


@dataclass(frozen=True)
class EngineEnv:
    engine: str
    version: str
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.root / "bin" / name

    @property
    def site_packages(self) -> Path:
        v = sys.version_info
        return self.root / "lib" / f"python{v.major}.{v.minor}" / "site-packages"


@dataclass(frozen=True)
class Pip:
    """`pip install --no-deps` of a pinned list shipped in `kvprobe/targets/shadow/pins/` and/or packages."""

    pins: str | None = None  # file name under kvprobe/targets/shadow/pins/
    packages: tuple[str, ...] = ()
    args: tuple[str, ...] = ()

    def describe(self) -> str:
        return " ".join(["pip install --no-deps", *self.args, *(["-r", self.pins] if self.pins else []),
                         *self.packages])

    def digest_text(self) -> str:
        text = pins_text(self.pins) if self.pins else ""
        return self.describe() + "\n" + text


@dataclass(frozen=True)
class Call:
    """A step written in Python (a stand-in package, a plugin's entry point) run against the env."""

    name: str
    fn: Callable[[EngineEnv], None]
    revision: str = "1"  # bump when what `fn` writes changes, so existing environments are rebuilt

    def describe(self) -> str:
        return self.name

    def digest_text(self) -> str:
        return f"{self.name} r{self.revision}"


def revision(*texts: str) -> str:
    """A Call's revision from the texts it writes: an edit to any of them rebuilds the environments."""
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:12]


def dist_info(dist_name: str, version: str, summary: str, entry_points: str, *,
              modules: tuple[str, ...] = ()) -> dict[str, str]:
    """The files of a distribution with no other code than `modules` (top-level .py files written beside
    it) whose entry points are `entry_points`, keyed by path under site-packages."""
    info = f"{dist_name}-{version}.dist-info"
    files = {"METADATA": f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\nSummary: {summary}\n",
             "entry_points.txt": entry_points}
    if modules:
        files["top_level.txt"] = "".join(f"{m}\n" for m in modules)
    files["INSTALLER"] = "kvprobe\n"
    # RECORD: one `path,hash,size` row per file; importlib.metadata reads it, and transformers'
    # packages_distributions() fails on a malformed one (an empty line breaks `import transformers`)
    names = [*(f"{m}.py" for m in modules), *(f"{info}/{n}" for n in [*files, "RECORD"])]
    files["RECORD"] = "".join(f"{n},,\n" for n in names)
    return {f"{info}/{name}": text for name, text in files.items()}


def write_distribution(env: EngineEnv, dist_name: str, files: dict[str, str], *, check: str, what: str,
                       timeout: float = 300) -> None:
    """Replace every version of `dist_name` in the env's site-packages with `files` (paths relative to
    site-packages: a dist-info and the modules it owns), then run `check` in the env's python."""
    for old in env.site_packages.glob(f"{dist_name}-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    for rel, text in files.items():
        path = env.site_packages / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    out = subprocess.run([str(env.python), "-c", check], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise EnvError(f"{what} in {env.root}: " + (out.stderr.strip().splitlines() or ["no output"])[-1])


@dataclass(frozen=True)
class Recipe:
    engine: str
    version: str
    steps: tuple[Pip | Call, ...]
    module: str  # the engine's import name; `module.__version__` must equal `version`
    notes: str = ""
    extra_checks: tuple[str, ...] = field(default=())  # more modules that must import

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for step in self.steps:
            h.update(step.digest_text().encode())
        return h.hexdigest()[:16]


def pins_text(name: str) -> str:
    return resources.files("kvprobe.targets.shadow").joinpath("pins", name).read_text("utf-8")


def pinned(name: str) -> dict[str, str]:
    """The pin list `name` as {normalised distribution name: version}; every line NAME==VERSION, once."""
    out: dict[str, str] = {}
    for n, line in enumerate(pins_text(name).splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        dist, sep, version = line.partition("==")
        if not sep or not version.strip():
            raise ValueError(f"pins/{name} line {n}: expected NAME==VERSION, got {line!r}")
        key = re.sub(r"[-_.]+", "-", dist.strip()).lower()
        if key in out:
            raise ValueError(f"pins/{name} line {n}: {dist.strip()} pinned twice")
        out[key] = version.strip()
    return out


RECIPES: dict[tuple[str, str], Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    RECIPES[(recipe.engine, recipe.version)] = recipe
    return recipe


register(Recipe(
    engine=VLLM, version=VLLM_DEFAULT_VERSION, module="vllm",
    steps=(Pip(pins=f"vllm-{VLLM_DEFAULT_VERSION}.txt"),),
    extra_checks=("vllm.v1.core.sched.scheduler", "vllm.entrypoints.openai.api_server"),
    notes="torch 2.13.0 CPU build in place of vLLM's pinned 2.14.0 (its scheduler and server do not care)",
))


def known_versions(engine: str) -> list[str]:
    return sorted((v for e, v in RECIPES if e == engine), key=version_tuple)


def parse_spec(spec: str) -> tuple[str, str]:
    """`vllm==0.33.0` -> ("vllm", "0.33.0"); `vllm` alone -> the default release, not the newest recipe."""
    engine, sep, version = spec.partition("==")
    engine = engine.strip().lower()
    if not any(e == engine for e, _ in RECIPES):
        engines = sorted({e for e, _ in RECIPES})
        raise ConfigError(f"unknown engine {engine!r} for a shadow environment: expected one of {engines}")
    if not sep:
        return engine, DEFAULT_VERSIONS[engine]
    return engine, version.strip()


def recipe(engine: str, version: str) -> Recipe:
    try:
        return RECIPES[(engine, version)]
    except KeyError:
        known = ", ".join(f"{engine}=={v}" for v in known_versions(engine)) or "none"
        raise ConfigError(
            f"no pinned install list for {engine} {version}: kvprobe can build shadow environments for "
            f"{known}") from None


def env_for(engine: str, version: str) -> EngineEnv:
    """Where this recipe's environment lives. The folder name carries the recipe's digest, so a
    changed pin list builds beside the old environment instead of tearing it down under a running
    engine; the old one is pruned once the new one is complete."""
    rec = recipe(engine, version)
    return EngineEnv(engine, version, cache_root() / "envs" / f"{engine}-{version}-{rec.digest}")


def _stale(env: EngineEnv) -> list[Path]:
    """Other environments of the same engine version: older recipes, or the pre-digest layout."""
    base = env.root.parent
    if not base.is_dir():
        return []
    same = re.compile(re.escape(f"{env.engine}-{env.version}") + r"(-[0-9a-f]{16})?")
    return [p for p in base.iterdir() if p.is_dir() and p != env.root and same.fullmatch(p.name)]


def install_command(engine: str, version: str) -> str:
    return f"kvprobe shadow install {engine}=={version}"


def _marker(env: EngineEnv) -> dict | None:
    try:
        return json.loads((env.root / MARKER).read_text())
    except (OSError, ValueError):
        return None


def find(engine: str, version: str) -> EngineEnv | None:
    """The complete environment for this recipe, or None (missing, partial, or an older recipe)."""
    rec = recipe(engine, version)
    env = env_for(engine, version)
    mark = _marker(env)
    if mark and mark.get("digest") == rec.digest and env.python.exists():
        return env
    return None


def require(engine: str, version: str) -> EngineEnv:
    """The environment, or one line that says how to make it."""
    env = find(engine, version)
    if env is None:
        state = "out of date" if _stale(env_for(engine, version)) else "not installed"
        raise EnvError(f"the {engine} {version} engine environment is {state} "
                       f"({env_for(engine, version).root}); run `{install_command(engine, version)}`")
    return env


def ensure(engine: str, version: str, *, log: Callable[[str], None] = print) -> EngineEnv:
    """The environment, installed first when it is missing (what tests and `make shadow-*` use)."""
    return find(engine, version) or install(engine, version, log=log)


@contextlib.contextmanager
def _locked(path: Path, timeout: float):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EnvError(f"another install holds {path} for more than {timeout:.0f} s") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


AFTER_INSTALL: list[Callable[..., None]] = []  # an install's last steps, lock held (disk adds file sharing)


def install(engine: str, version: str, *, log: Callable[[str], None] = print, force: bool = False) -> EngineEnv:
    """Build the environment from its recipe (idempotent; a partial one is removed first)."""
    rec = recipe(engine, version)
    env = env_for(engine, version)
    with _locked(env.root.with_name(env.root.name + ".lock"), LOCK_TIMEOUT):
        if not force and find(engine, version) is not None:
            log(f"kvprobe shadow: {engine} {version} environment is ready at {env.root}")
            return env
        if env.root.exists():
            log(f"kvprobe shadow: removing the incomplete or outdated environment at {env.root}")
            shutil.rmtree(env.root)
        deadline = time.monotonic() + INSTALL_TIMEOUT
        t0 = time.monotonic()
        log(f"kvprobe shadow: creating {env.root} ({len(rec.steps)} install steps)")
        _run([sys.executable, "-m", "venv", str(env.root)], log=log, deadline=deadline, what="venv")
        for i, step in enumerate(rec.steps, 1):
            log(f"kvprobe shadow: [{i}/{len(rec.steps)}] {step.describe()}")
            if isinstance(step, Pip):
                _pip(env, step, log=log, deadline=deadline)
            else:
                step.fn(env)
        found = check(env, rec, deadline=deadline)
        (env.root / MARKER).write_text(json.dumps({
            "engine": engine, "version": version, "digest": rec.digest, "engine_version": found,
            "python": sys.version.split()[0], "installed": time.time(),
            "seconds": round(time.monotonic() - t0, 1)}, indent=1))
        log(f"kvprobe shadow: {engine} {found} ready at {env.root} ({time.monotonic() - t0:.0f} s)")
        for old in _stale(env):
            log(f"kvprobe shadow: removing the environment of an older recipe at {old}")
            shutil.rmtree(old, ignore_errors=True)
            old.with_name(old.name + ".lock").unlink(missing_ok=True)
        for last_step in AFTER_INSTALL:
            last_step(env.root, log=log)
        return env


def _pip(env: EngineEnv, step: Pip, *, log, deadline: float) -> None:
    argv = [str(env.python), "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
            "--progress-bar", "off", *step.args]
    if step.pins:
        with resources.as_file(resources.files("kvprobe.targets.shadow").joinpath("pins", step.pins)) as pins:
            _run([*argv, "-r", str(pins), *step.packages], log=log, deadline=deadline, what=step.describe())
    else:
        _run([*argv, *step.packages], log=log, deadline=deadline, what=step.describe())


def _run(argv: list[str], *, log, deadline: float, what: str) -> None:
    """Run one install command in its own process group, streaming its output to `log`."""
    tail: list[str] = []
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PIP_NO_INPUT": "1"})
    try:
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-15:]
            # pip's "Requirement already satisfied" noise is not progress
            if line and not line.startswith("Requirement already satisfied"):
                log(f"    {line}")
            if time.monotonic() > deadline:
                raise EnvError(f"{what}: not finished within {INSTALL_TIMEOUT:.0f} s")
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise EnvError(f"{what}: not finished within {INSTALL_TIMEOUT:.0f} s") from None
    finally:
        if proc.poll() is None:
            stop_group(proc, proc.pid, 5.0)
    if rc != 0:
        raise EnvError(f"{what} failed with exit code {rc}:\n" + "\n".join(tail))


def check(env: EngineEnv, rec: Recipe, *, deadline: float | None = None) -> str:
    """Import the engine in the environment; return its version or raise EnvError with the reason."""
    code = (f"import importlib, sys\nimport {rec.module} as m\n"
            f"for name in {list(rec.extra_checks)!r}: importlib.import_module(name)\n"
            "print(m.__version__)")
    timeout = 600.0 if deadline is None else max(10.0, deadline - time.monotonic())
    try:
        out = subprocess.run([str(env.python), "-c", code], capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, **shadow_import_env(rec.engine)})
    except subprocess.TimeoutExpired:
        raise EnvError(f"importing {rec.module} in {env.root} took more than {timeout:.0f} s") from None
    if out.returncode != 0:
        last = [ln for ln in out.stderr.strip().splitlines() if ln.strip()][-12:]
        reason = last[-1] if last else f"exit code {out.returncode}"
        raise EnvError(f"{rec.module} does not import in {env.root}: {reason}\n" + "\n".join(last))
    found = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "?"
    if found.split("+")[0] != rec.version:
        raise EnvError(f"{env.root} holds {rec.module} {found}, expected {rec.version}")
    return found


def shadow_import_env(engine: str) -> dict[str, str]:
    """The environment an engine needs to import and run on a CPU (a dialect fact; none for an
    engine kvprobe has no dialect of, such as the tests' stand-in)."""
    return dict(get_dialect(engine).SHADOW_ENV) if engine in ENGINES else {}

