"""The plugin's options: each `--kvprobe-NAME` on the command line is also the ini key `kvprobe_NAME`
(so every option works from pyproject.toml); the command line wins."""

from __future__ import annotations

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


def get_option(config, name: str):
    """The command-line value, else the ini value (so every option works from pyproject.toml)."""
    if name == "kvprobe":
        value = config.getoption("kvprobe")
        return bool(config.getini("kvprobe")) if value is None else value
    value = config.getoption(_dest(name))
    if value is None:
        value = config.getini(_dest(name))
    return value or None
