"""The suite's shared plumbing: pytester, the measured figures the engine-bound tests print, and the
one group the tests on the real engines' code run in when the suite runs on several workers.

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`): the tests under
ENGINE_DIRS (real vLLM / SGLang serving code, tuned for a busy two-core machine) run one after
another on one worker, first; everything else runs on the other worker beside them. Run alone, the
suite is the same tests in the same order.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

# The tests that start the real engines' code (servers, planners, schedulers): one unit of work,
# never two of them at once; handed out first, as the longest unit (xdist's --loadscope-reorder).
ENGINE_DIRS = ("tests/shadow/", "tests/shadow_sglang/", "tests/shadow_env/")
ENGINE_GROUP = "engines"
FIGURES = "measured figures"  # the user_properties key a test's figure lines travel under
_reported: list[tuple[str, str]] = []


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with the engine tests as one group, by path. (xdist's own xdist_group
    marks rename node ids, which pytest 9 no longer lets a plugin do.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EngineGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ENGINE_GROUP if nodeid.startswith(ENGINE_DIRS) else nodeid

    return EngineGroupScheduling(config, log)


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
