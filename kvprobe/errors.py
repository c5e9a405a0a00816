"""The errors kvprobe reports to a person: one line, no traceback.

`KvprobeError` and its subclasses are *expected* failures (bad input, a target that will not
start). The console prints `str(err)` and exits with `err.exit_code`; the pytest plugin turns
them into a one-line failure or collection error.
"""

from __future__ import annotations


class KvprobeError(Exception):
    """A failure the user can act on; printed as one line."""

    exit_code = 2


class ConfigError(KvprobeError):
    """Bad input: a flag, a config.json, an expectation or a profile."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None):
        self.file = file
        self.key = key
        where = ": ".join(p for p in (file, key) if p)
        super().__init__(f"{where}: {message}" if where else message)


def spec_error(file: str, key: str, expected: str, got: object = None) -> ConfigError:
    """`file: key: expected <expected>, got <got>` — the shape every validation error takes."""
    shown = "" if got is None else f", got {got!r}"
    return ConfigError(f"expected {expected}{shown}", file=file, key=key)


class TargetError(KvprobeError):
    """The engine could not be launched, reached or kept alive; carries the log tail."""

    exit_code = 3

    def __init__(self, message: str, *, log_tail: str = ""):
        self.log_tail = log_tail
        super().__init__(message + (f"\n--- engine log (last lines) ---\n{log_tail}" if log_tail else ""))


class ProbeError(KvprobeError):
    """The probe itself could not complete (load generator died, budget exceeded...)."""

    exit_code = 3
