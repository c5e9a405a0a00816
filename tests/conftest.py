"""The suite's shared plumbing: pytester, the measured figures the engine-bound tests print, and how
the suite shares two cores when it runs on two pytest-xdist workers (`make test`).

On two workers (`-n 2 --dist loadgroup`) the end-to-end tests — everything under ENGINE_DIRS (the
real vLLM / SGLang code) and every module with a SERIAL_SIGN (servers and Locust, or the clock) —
are one unit of work: one worker runs them one after another, first, as a run on one worker does.
They are tuned for a busy two-core machine, and their probes judge their own client's lag, so none
of them runs beside another. The other worker runs the rest (unit tests: no servers, no clock)
beside them at a lower CPU priority (nice 10), so a probe's engine and client still get the cores
when they need them. Run on one worker, the suite is the same tests in the same order.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ENGINE_DIRS = ("tests/shadow/", "tests/shadow_sglang/", "tests/shadow_env/")
# a module that marks a test slow, or reads or waits on the clock (a bound on how long something
# took, a deadline), runs in the end-to-end unit: none of its tests shares the cores with a probe
SERIAL_SIGNS = ("mark.slow", "time.monotonic", "time.time(", "time.sleep", "wait_for(", "timeout=")
SERIAL_GROUP = "end-to-end"
YIELDING_NICE = 10  # the priority of the other worker's tests
FIGURES = "measured figures"  # the user_properties key a test's figure lines travel under
_reported: list[tuple[str, str]] = []


@functools.cache
def _serial_module(root: Path, path: str) -> bool:
    if path.startswith(ENGINE_DIRS):
        return True
    try:
        text = (root / path).read_text(encoding="utf-8")
    except OSError:
        return False
    return any(sign in text for sign in SERIAL_SIGNS)


def serial(root: Path, nodeid: str) -> bool:
    """Does the test `nodeid` (relative to `root`) run in the end-to-end unit?"""
    return _serial_module(root, nodeid.split("::", 1)[0])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with the end-to-end tests as one group, found by module. (xdist's own
    xdist_group marks rename node ids, which pytest 9 no longer lets a plugin do.) xdist hands
    out the largest unit first (--loadscope-reorder, its default)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class EndToEndGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SERIAL_GROUP if serial(root, nodeid) else nodeid

    return EndToEndGroupScheduling(config, log)


def pytest_runtest_setup(item):
    # a worker's unit tests yield the cores to the end-to-end tests running beside them (the
    # priority holds for the rest of the worker's life: the end-to-end unit, handed out first,
    # has run on its worker before any other test there)
    if os.environ.get("PYTEST_XDIST_WORKER") and not serial(item.config.rootpath, item.nodeid):
        if os.getpriority(os.PRIO_PROCESS, 0) < YIELDING_NICE:
            os.setpriority(os.PRIO_PROCESS, 0, YIELDING_NICE)


def add_figure(node: pytest.Item, line: str) -> None:
    """A figure line of `node`'s test: in the run's summary (from any worker), as well as wherever
    the test printed it."""
    node.user_properties.append((FIGURES, line))


def pytest_runtest_logreport(report):
    # the teardown report carries every line the test added; with xdist it reaches the controller
    if report.when == "teardown":
        _reported.extend((report.nodeid, value) for key, value in report.user_properties if key == FIGURES)


def pytest_terminal_summary(terminalreporter):
    if not _reported:
        return
    terminalreporter.write_sep("=", "measured figures")
    last = None
    for nodeid, line in _reported:
        if nodeid != last:
            terminalreporter.write_line(f"{nodeid}:")
            last = nodeid
        for part in line.strip("\n").splitlines():
            terminalreporter.write_line(f"  {part}")
