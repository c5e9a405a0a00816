"""The house: every module imports, no module imports its way back to itself, the layers of the data
path hold (import-linter's contracts in pyproject.toml), and no module grows past the size a reader
takes in at once without a stated reason; and what ships cites only the repository and the engines'
source, never a path beside the clone."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvprobe

PACKAGE = Path(kvprobe.__file__).resolve().parent
MAX_LINES = 400

# Modules that run only inside an engine's own environment (the shadow's worker and plugin hooks):
# here they may fail to import, and only for want of that engine's packages.
ENGINE_SIDE = {
    "kvprobe.targets.shadow.sglang.hooks": {"torch", "sglang"},
    "kvprobe.targets.shadow.vllm.compat": {"vllm"},
    "kvprobe.targets.shadow.vllm.kvplan": {"torch", "vllm"},
    "kvprobe.targets.shadow.vllm.kvspec": {"torch", "vllm"},
    "kvprobe.targets.shadow.vllm.worker": {"torch", "vllm"},
}

# Modules allowed past MAX_LINES, each with the reason a split would cost more than it gives.
OVERSIZE: dict[str, str] = {
    "kvprobe.theory.vllm.hybrid.single_type_managers":
        "a port of one vLLM file (vllm/v1/core/single_type_kv_cache_manager.py): its managers side by side, as there",
}


def module_names() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(kvprobe.__path__, "kvprobe.")]
    return sorted(n for n in names if not n.endswith("__main__"))


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        files[".".join(parts)] = path
    return files


# Modules whose import monkey-patches the interpreter (Locust patches with gevent on import): imported
# in a fresh one, or the xdist worker running this test blocks forever on its patched queue
# (gevent's LoopExit) the next time it waits for an item.
PATCHES_ON_IMPORT = {"kvprobe.load.locustfile"}


@pytest.mark.parametrize("name", module_names())
def test_every_module_imports(name):
    if name in PATCHES_ON_IMPORT:
        proc = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=PACKAGE.parent, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-2000:]}"
        return
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".")[0]
        assert missing in ENGINE_SIDE.get(name, set()), f"{name}: {err}"


def import_graph() -> dict[str, set[str]]:
    """Every kvprobe-to-kvprobe import, top-level or inside a function: a lazy import that only
    dodges a cycle is still a cycle."""
    files = module_files()

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in files:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                found = owner(target) if target.startswith("kvprobe.") else None
                if found and found != mod and found != "kvprobe" and not mod.startswith(found + "."):
                    graph[mod].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    # in a fresh interpreter: after another test here imported the locustfile (gevent patches the
    # process), CPython 3.11.7's ast.parse failed once with "AST constructor recursion depth mismatch"
    code = "import json; from tests.test_house import cycles, import_graph; print(json.dumps(cycles(import_graph())))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_the_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_past_the_line_limit_without_a_reason():
    big = {}
    for name, path in module_files().items():
        lines = len(path.read_text("utf-8").splitlines())
        if lines > MAX_LINES and name not in OVERSIZE:
            big[name] = lines
    assert big == {}
    stale = [n for n in OVERSIZE if len(module_files()[n].read_text("utf-8").splitlines()) <= MAX_LINES]
    assert stale == [], "no longer over the limit: drop from OVERSIZE"


def test_the_layers_hold():
    """import-linter's contracts (pyproject.toml [tool.importlinter]): the data path's layers and the
    engines' independence from each other."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is a test dependency: pip install -e '.[test]'"
    root = PACKAGE.parent
    proc = subprocess.run([exe, "--config", str(root / "pyproject.toml")], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


# What a clone ships: the code, the docs, the expectations and the recipes' pin lists. A citation
# of the notes the project began from (../shared) points nowhere in someone else's clone; the
# repository keeps its own copy of what it cites (tests/data/reference).
SHIPPED = ("kvprobe", "docs", "expectations", "bench", "README.md", "Makefile", "pyproject.toml")
OUTSIDE = ("shared/reference", "shared/fixtures", "shared/seeds", "../shared")


def outside_citations(root: Path) -> list[str]:
    hits = []
    for top in SHIPPED:
        base = root / top
        for path in [base] if base.is_file() else sorted(base.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text("utf-8")
            except UnicodeDecodeError:
                continue  # a plot, a wheel: not prose
            for n, line in enumerate(text.splitlines(), 1):
                if any(mark in line for mark in OUTSIDE):
                    hits.append(f"{path.relative_to(root)}:{n}: {line.strip()[:120]}")
    return hits


def test_nothing_shipped_cites_a_path_outside_the_repository(tmp_path):
    assert outside_citations(PACKAGE.parent) == []
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("as measured (shared/reference/vllm.md)\n")
    assert outside_citations(tmp_path) == ["docs/x.md:1: as measured (shared/reference/vllm.md)"]


# The README is the front door (what kvprobe is, the two commands, staging, pytest, the ledger, shadows,
# releases, fleets): the rest lives in docs/, and every page it links to is there.
README_LINES = 200


def test_the_readme_is_a_front_door_whose_links_resolve():
    readme = PACKAGE.parent / "README.md"
    text = readme.read_text("utf-8")
    assert len(text.splitlines()) <= README_LINES, f"README.md: {len(text.splitlines())} lines > {README_LINES}"
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert "docs/architecture.md" in links and "docs/development.md" in links
    missing = [link for link in links if not link.startswith("http") and not (readme.parent / link).is_file()]
    assert missing == [], f"README.md links to pages that do not exist: {missing}"
