"""Fixtures for hand-written kvprobe tests (registered by the plugin)."""

from __future__ import annotations

from pathlib import Path

import pytest


def _expectation(request, spec):
    """An Expectation from an object, a file path, or `path::name`."""
    from kvprobe.spec.expectation import load_expectations

    if not isinstance(spec, (str, Path)):
        return spec
    path, _, name = str(spec).partition("::")
    path = Path(path)
    if not path.is_absolute():
        path = Path(str(request.config.rootpath)) / path
    found = load_expectations(path)
    if name:
        found = [e for e in found if e.name == name]
    if len(found) != 1:
        raise pytest.UsageError(f"{spec}: expected exactly one expectation, found {len(found)}")
    return found[0]


@pytest.fixture
def kvprobe_ledger(request):
    """`kvprobe_ledger(expectation_or_path, users=None)` → the Ledger predicted for it (no server)."""
    from kvprobe.probe.run import predict

    return lambda spec, users=None: predict(_expectation(request, spec), users=users)


@pytest.fixture(scope="session")
def kvprobe_target(request):
    """`kvprobe_target(expectation_or_path)` → a launched or attached Target, shared by every test of
    the session asking for the same engine configuration and stopped at the end of the session —
    also on failure or Ctrl-C (pytest runs session finalizers, and the launcher has an atexit guard)."""
    from kvprobe.probe.run import open_target

    session = request.config._kvprobe
    if not session.enabled:
        pytest.skip("kvprobe_target needs --kvprobe")

    def get(spec):
        exp = _expectation(request, spec)
        key = (exp.engine, exp.version, exp.model, tuple(sorted(map(str, exp.flags.items()))),
               session.url or exp.target.url)
        if key not in session.targets:
            directory = session.artifacts / f"target-{len(session.targets)}"
            directory.mkdir(parents=True, exist_ok=True)
            session.targets[key] = open_target(exp, session.options(exp), directory)
        return session.targets[key]

    yield get
    session.close()


@pytest.fixture
def kvprobe_run(request):
    """`kvprobe_run(expectation_or_path, **overrides)` → ProbeResult of a fresh probe."""
    from dataclasses import replace

    from kvprobe.probe.run import run_probe

    session = request.config._kvprobe
    if not session.enabled:
        pytest.skip("kvprobe_run needs --kvprobe")

    def run(spec, **overrides):
        exp = _expectation(request, spec)
        options = session.options(exp)
        return run_probe(exp, replace(options, **overrides) if overrides else options)

    return run
