"""Validation primitives of the spec: a YAML value that knows its file and key path (`Node`), and
the strict YAML reader.

Every check raises `spec_error(file, "key.path[2].sub", expected, got)`, so each mistake in an
expectation or a profile is reported as one line naming the file, the key and what was expected.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable
from pathlib import Path

import yaml

from kvprobe.errors import ConfigError, spec_error

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,79}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MISSING = object()


class Shown(str):
    """A description printed as is in `got` (spec_error shows `got!r`; this avoids quotes)."""

    def __repr__(self) -> str:
        return str(self)


def show(value: object) -> object:
    """A short, single-line rendering of a YAML value for an error message."""
    if isinstance(value, dict):
        return Shown(f"a mapping with keys {', '.join(map(str, list(value)[:6]))}" if value else "an empty mapping")
    if isinstance(value, list):
        return Shown(f"a list of {len(value)}")
    if value is None:
        return Shown("nothing (null)")
    if isinstance(value, str) and len(value) > 60:
        return value[:57] + "..."
    return value


def did_you_mean(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Node:
    """A value read from YAML, with the file it came from and its key path inside that file."""

    __slots__ = ("value", "file", "path")

    def __init__(self, value: object, file: str, path: str = ""):
        self.value = value
        self.file = file
        self.path = path

    def child(self, key: str | int) -> Node:
        if isinstance(key, int):
            path = f"{self.path}[{key}]"
            value = self.value[key]  # type: ignore[index]
        else:
            path = f"{self.path}.{key}" if self.path else key
            value = self.value.get(key) if isinstance(self.value, dict) else None
        return Node(value, self.file, path)

    def error(self, expected: str, got: object = _MISSING) -> ConfigError:
        shown = show(self.value) if got is _MISSING else got
        return spec_error(self.file, self.path or "(top level)", expected, shown)

    # -- containers -------------------------------------------------------------------------

    def mapping(self, allowed: Iterable[str], *, required: Iterable[str] = (), what: str = "") -> dict[str, Node]:
        """Check a mapping with string keys, no unknown key, every required key present."""
        allowed = list(allowed)
        if not isinstance(self.value, dict):
            raise self.error(what or f"a mapping with keys {', '.join(allowed)}")
        for key in self.value:
            if not isinstance(key, str):
                raise spec_error(self.file, f"{self.path}[{key!r}]" if self.path else repr(key),
                                 "a text key", Shown(type(key).__name__))
            if key not in allowed:
                raise self.child(key).error(
                    f"a known key{' of ' + self.path if self.path else ''}: {', '.join(allowed)}"
                    f"{did_you_mean(key, allowed)}", Shown(f"unknown key {key!r}"))
        for key in required:
            if key not in self.value:
                raise self.child(key).error("this key to be present", Shown("nothing (missing)"))
        return {key: self.child(key) for key in self.value}

    def seq(self, *, nonempty: bool = False, what: str = "a list") -> list[Node]:
        if not isinstance(self.value, list):
            raise self.error(what)
        if nonempty and not self.value:
            raise self.error(f"{what}, not empty", Shown("an empty list"))
        return [self.child(i) for i in range(len(self.value))]

    # -- scalars ----------------------------------------------------------------------------

    def integer(self, *, lo: int | None = None, hi: int | None = None, what: str = "an integer") -> int:
        v = self.value
        if isinstance(v, float) and v.is_integer() and not isinstance(v, bool):
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(_bounded(what, lo, hi))
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self.error(_bounded(what, lo, hi))
        return v

    def number(self, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
               hi_open: bool = False, what: str = "a number") -> float:
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise self.error(_bounded(what, lo, hi, lo_open, hi_open))
        too_low = lo is not None and (v <= lo if lo_open else v < lo)
        too_high = hi is not None and (v >= hi if hi_open else v > hi)
        if too_low or too_high:
            raise self.error(_bounded(what, lo, hi, lo_open, hi_open))
        return float(v)

    def string(self, *, pattern: re.Pattern | None = None, what: str = "a text value") -> str:
        v = self.value
        if not isinstance(v, str) or not v.strip():
            raise self.error(what)
        if pattern is not None and not pattern.match(v):
            raise self.error(what)
        return v

    def boolean(self, *, what: str = "true or false") -> bool:
        if not isinstance(self.value, bool):
            raise self.error(what)
        return self.value

    def choice(self, options: Iterable[str], *, what: str = "") -> str:
        options = list(options)
        v = self.value
        if not isinstance(v, str) or v not in options:
            hint = did_you_mean(v, options) if isinstance(v, str) else ""
            raise self.error(f"{what or 'one of'} {', '.join(options)}{hint}")
        return v


def _bounded(what: str, lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    def fmt(x):
        return f"{x:g}" if isinstance(x, float) else str(x)

    if lo is not None and hi is not None:
        return f"{what} in {'(' if lo_open else '['}{fmt(lo)}, {fmt(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{what} {'>' if lo_open else '>='} {fmt(lo)}"
    if hi is not None:
        return f"{what} {'<' if hi_open else '<='} {fmt(hi)}"
    return what


# -- YAML -------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (PyYAML keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[object, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain value", key_node.start_mark) from None
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {first + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def read_yaml(path: str | Path) -> object:
    """Parse one YAML file; every failure is a one-line ConfigError naming the file."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise spec_error(file, "(file)", "an existing YAML file", Shown("no such file")) from None
    except IsADirectoryError:
        raise spec_error(file, "(file)", "a YAML file", Shown("a directory")) from None
    except UnicodeDecodeError as err:
        raise spec_error(file, "(file)", "UTF-8 text", Shown(f"undecodable byte at offset {err.start}")) from None
    except OSError as err:
        raise spec_error(file, "(file)", "a readable YAML file", Shown(one_line(err.strerror or err))) from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(yaml)"
        problem = one_line(err.problem or err.context or "a syntax error")
        cm = err.context_mark
        if err.context and err.problem and cm is not None:  # where the unfinished construct began
            problem += f" ({one_line(err.context)} at line {cm.line + 1}, column {cm.column + 1})"
        raise spec_error(file, where, "valid YAML", Shown(problem)) from None
    except yaml.YAMLError as err:
        raise spec_error(file, "(yaml)", "valid YAML", Shown(one_line(err))) from None
