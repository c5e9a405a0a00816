"""pytest plugin (entry point `pytest11: kvprobe`): options, collection of expectation files, hooks.

Fixtures live in `kvprobe.pytest_plugin.fixtures`, run-level state in `kvprobe.pytest_plugin.session` (the
pytest-benchmark split), the options in `kvprobe.pytest_plugin.options`. `-p no:kvprobe` disables all of it. Option
names are prefixed `--kvprobe-` because Locust's own auto-loaded pytest plugin already claims `--host`/`-H` and a
`session` fixture.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprobe.errors import KvprobeError
from kvprobe.pytest_plugin import fixtures
from kvprobe.pytest_plugin.options import OPTIONS, _dest, get_option
from kvprobe.pytest_plugin.session import ExpectationFile, KvprobeSession


def pytest_addoption(parser) -> None:
    group = parser.getgroup("kvprobe", "kvprobe: KV-cache admission probes")
    group.addoption("--kvprobe", action="store_true", default=None,
                    help="run kvprobe probes (without it they are collected and skipped)")
    parser.addini("kvprobe", "run kvprobe probes (same as --kvprobe)", type="bool", default=False)
    for name, help_text, ini_type, default in OPTIONS:
        action = "append" if ini_type == "linelist" else "store"
        nargs = "+" if ini_type == "paths" else None
        kwargs = {"nargs": nargs} if nargs else {}
        group.addoption(f"--kvprobe-{name}", dest=_dest(name), action=action, default=None,
                        metavar=name.upper().replace("-", "_"), help=help_text, **kwargs)
        parser.addini(_dest(name), help_text, type=ini_type, default=default)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "kvprobe: a test that needs a live engine (skipped without --kvprobe)")
    config._kvprobe = KvprobeSession(config)
    config.pluginmanager.register(fixtures, "kvprobe-fixtures")
    config._kvprobe.extend_args()


def pytest_report_header(config) -> list[str]:
    return config._kvprobe.header_lines()


def pytest_collect_file(file_path: Path, parent):
    session = parent.config._kvprobe
    if file_path.suffix in (".yaml", ".yml") and session.is_expectation_file(file_path):
        return ExpectationFile.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config, items) -> None:
    if get_option(config, "kvprobe"):
        return
    skip = pytest.mark.skip(reason="kvprobe probe: needs --kvprobe (a live engine or the emulator)")
    for item in items:
        if item.get_closest_marker("kvprobe"):
            item.add_marker(skip)


def pytest_collection_finish(session) -> None:
    """Name the expectations that were collected, under pytest's own "collected N items"."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in session.config._kvprobe.collected_lines(session.items):
            reporter.write_line(line)


def pytest_sessionfinish(session, exitstatus) -> None:
    """Bad input (a refused API key, the other engine) ends the run as a usage error, as the console's
    exit 2 does: the user's command or file needs fixing, not the engine."""
    kvp = getattr(session.config, "_kvprobe", None)
    if kvp is not None and kvp.bad_input and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        session.exitstatus = pytest.ExitCode.USAGE_ERROR


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    text = config._kvprobe.summary_table()
    bad = [f"kvprobe: bad input: {name}: {err}" for name, err in config._kvprobe.bad_input.items()]
    if text or bad:
        terminalreporter.write_sep("=", "kvprobe summary")
        for line in ([text] if text else []) + bad:
            terminalreporter.write_line(line)


def pytest_unconfigure(config) -> None:
    session = getattr(config, "_kvprobe", None)
    if session is not None:
        session.close()


__all__ = ["KvprobeError", "get_option"]
