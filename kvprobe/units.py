"""Byte sizes and counts as people (and vLLM's CLI) write them.

Two conventions meet here and must not be confused:

* Memory sizes: ``GiB``/``MiB``/``KiB``/``TiB`` are binary, ``GB``/``MB``/``KB``/``TB`` are decimal
  (``80GB`` is 80e9, which is how a card's marketing size is written, not its ``memory.total``).
* vLLM's "human units" for integer flags (``vllm/engine/arg_utils.py::human_readable_int``, 0.33.0):
  a single *lower-case* suffix is decimal (``1k`` = 1000), a single *upper-case* suffix is binary
  (``1K`` = 1024, ``10G`` = 10 * 2**30). ``parse_bytes`` follows the same rule for single letters.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from kvprobe.errors import ConfigError

_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def _split(text: str | int, key: str, what: str) -> tuple[Decimal, str]:
    if isinstance(text, bool):
        raise ConfigError(f"expected {what}, got {text!r}", key=key or None)
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"expected {what} (not negative), got {text!r}", key=key or None)
        return Decimal(text), ""
    match = _NUMBER_UNIT.match(str(text))
    if not match:
        raise ConfigError(f"expected {what}, got {text!r}", key=key or None)
    try:
        return Decimal(match.group(1)), match.group(2)
    except InvalidOperation as err:  # pragma: no cover - the regex already guarantees a number
        raise ConfigError(f"expected {what}, got {text!r}", key=key or None) from err


def _single_letter_factor(unit: str) -> int | None:
    """vLLM's rule: lower-case letter = decimal, upper-case letter = binary."""
    low = unit.lower()
    if low not in _BINARY:
        return None
    return _DECIMAL[low] if unit.islower() else _BINARY[low]


def _to_int(value: Decimal, text: object, key: str, what: str) -> int:
    if value != value.to_integral_value():
        raise ConfigError(f"expected {what} that is a whole number, got {text!r}", key=key or None)
    return int(value)


def parse_bytes(text: str | int, *, key: str = "") -> int:
    """'24GiB', '24 GiB', '80GB' (80e9), '512MiB', '10G' (10*2**30), '4096', 4096 -> bytes."""
    what = "a byte size such as 24GiB, 512MiB, 80GB or a plain number of bytes"
    number, unit = _split(text, key, what)
    if unit in ("", "B", "b"):
        factor = 1
    elif len(unit) == 1:
        factor = _single_letter_factor(unit)
    else:
        low = unit.lower()
        if low.endswith("ib") and len(low) == 3:
            factor = _BINARY.get(low[0])
        elif low.endswith("b") and len(low) == 2:
            factor = _DECIMAL.get(low[0])
        else:
            factor = None
    if factor is None:
        raise ConfigError(f"expected {what}, got {text!r} (unknown unit {unit!r})", key=key or None)
    return _to_int(number * factor, text, key, what)


def parse_count(text: str | int, *, key: str = "") -> int:
    """vLLM human units for counts: '1k' = 1000, '1K' = 1024, '8192', 8192."""
    what = "a count such as 8192, 8k (8000) or 8K (8192)"
    number, unit = _split(text, key, what)
    if unit == "":
        factor = 1
    elif len(unit) == 1:
        factor = _single_letter_factor(unit)
    else:
        factor = None
    if factor is None:
        raise ConfigError(f"expected {what}, got {text!r} (unknown unit {unit!r})", key=key or None)
    return _to_int(number * factor, text, key, what)


_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: int | float) -> str:
    """7647... -> '7.12 GiB': the largest binary unit the value reaches, two decimals."""
    sign = "-" if n < 0 else ""
    size = abs(n)
    for name, factor in _UNITS:
        if size >= factor:
            return f"{sign}{size / factor:.2f} {name}"
    return f"{sign}{int(size)} B"
