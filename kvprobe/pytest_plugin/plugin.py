"""pytest plugin (entry point `pytest11: kvprobe`): options, collection of expectation files, hooks.

Fixtures live in `kvprobe.pytest_plugin.fixtures`, run-level state in `kvprobe.pytest_plugin.session` (the pytest-benchmark
split). `-p no:kvprobe` disables all of it. Option names are prefixed `--kvprobe-` because Locust's
own auto-loaded pytest plugin already claims `--host`/`-H` and a `session` fixture.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprobe.errors import KvprobeError

# (name, help, ini type, default); every option is also an ini key `kvprobe_<name>`.
OPTIONS = [
    ("expectations", "expectation files or directories to collect (default: expectations)", "paths", None),
    ("url", "attach every probe to this engine URL instead of launching", "string", None),
    ("engine-command", "the engine command to launch instead of the dialect default", "string", None),
    ("artifacts", "directory for probe artifacts (default: artifacts/kvprobe)", "string", None),
    ("tolerance", "tolerance override NAME=VALUE (repeatable), e.g. rejection_point=2", "linelist", None),
    ("budget", "time budget per probe, seconds", "string", None),
    ("profile", "load profile name or path replacing every expectation's", "string", None),
]


def _dest(name: str) -> str:
    return "kvprobe_" + name.replace("-", "_")


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


def get_option(config, name: str):
    """The command-line value, else the ini value (so every option works from pyproject.toml)."""
    if name == "kvprobe":
        value = config.getoption("kvprobe")
        return bool(config.getini("kvprobe")) if value is None else value
    value = config.getoption(_dest(name))
    if value is None:
        value = config.getini(_dest(name))
    return value or None


def pytest_configure(config) -> None:
    from kvprobe.pytest_plugin.session import KvprobeSession

    config.addinivalue_line("markers", "kvprobe: a test that needs a live engine (skipped without --kvprobe)")
    config._kvprobe = KvprobeSession(config)
    config.pluginmanager.register(__import__("kvprobe.pytest_plugin.fixtures", fromlist=["*"]), "kvprobe-fixtures")
    config._kvprobe.extend_args()


def pytest_report_header(config) -> list[str]:
    return config._kvprobe.header_lines()


def pytest_collect_file(file_path: Path, parent):
    session = parent.config._kvprobe
    if file_path.suffix in (".yaml", ".yml") and session.is_expectation_file(file_path):
        from kvprobe.pytest_plugin.session import ExpectationFile

        return ExpectationFile.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config, items) -> None:
    if get_option(config, "kvprobe"):
        return
    skip = pytest.mark.skip(reason="kvprobe probe: needs --kvprobe (a live engine or the emulator)")
    for item in items:
        if item.get_closest_marker("kvprobe"):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    text = config._kvprobe.summary_table()
    if text:
        terminalreporter.write_sep("=", "kvprobe summary")
        terminalreporter.write_line(text)


def pytest_unconfigure(config) -> None:
    session = getattr(config, "_kvprobe", None)
    if session is not None:
        session.close()


__all__ = ["KvprobeError", "get_option"]
