"""Byte sizes and counts as people (and vLLM's CLI) write them.

Two conventions meet here and must not be confused:

* Memory sizes: ``GiB``/``MiB``/``KiB``/``TiB`` are binary, ``GB``/``MB``/``KB``/``TB`` are decimal
  (``80GB`` is 80e9, which is how a card's marketing size is written, not its ``memory.total``).
  ``parse_memory_size`` takes only these (a GPU's memory: ``--gpu-memory``, ``hardware.gpu_memory``):
  a bare number or a single letter (``24``, ``24G``, ``24g``) is refused rather than guessed.
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


_MEMORY_UNIT = re.compile(r"^([KMGTkmgt]?)(i?)B$", re.IGNORECASE)


def memory_unit_error(text: object, key: str) -> ConfigError:
    """What was read and the two accepted forms, e.g. `'24' has no unit: write 24GiB (binary) or 24GB (decimal)`."""
    shown = str(text).strip()
    match = _NUMBER_UNIT.match(shown)
    number, unit = (match.group(1), match.group(2)) if match else ("24", None)
    letter = (unit[:1] or "G").upper() if unit and unit[:1].lower() in _BINARY else "G"
    forms = f"write {number}{letter}iB (binary) or {number}{letter}B (decimal)"
    if unit == "" and Decimal(number) >= 2**20:  # a count of bytes, as torch prints it
        forms = f"write {number}B for bytes, or a size such as 24GiB (binary) or 24GB (decimal)"
    if unit is None:
        return ConfigError(f"{shown!r} is not a memory size: {forms}", key=key or None)
    if unit == "":
        return ConfigError(f"{shown!r} has no unit: {forms}", key=key or None)
    if len(unit) == 1 and unit.lower() in _BINARY:
        return ConfigError(f"{shown!r} has a one-letter unit, binary or decimal is not clear: {forms}", key=key or None)
    return ConfigError(f"{shown!r} has an unknown unit {unit!r}: {forms}", key=key or None)


def parse_memory_size(text: str | int, *, key: str = "") -> int:
    """A memory size with an explicit unit, meant as written: '24GiB' = 24 * 2**30, '80GB' = 80e9,
    '79.19GiB' (rounded to the byte), '85045477376B', in any case ('24gib', '80gb'); a bare
    number or a one-letter unit ('24G', '24g': vLLM's human units) is an error."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise memory_unit_error(text, key)
    match = _NUMBER_UNIT.match(str(text))
    unit = _MEMORY_UNIT.match(match.group(2)) if match else None
    if isinstance(text, (int, float)) or unit is None:
        raise memory_unit_error(text, key)
    letter, binary = unit.group(1).lower(), bool(unit.group(2))
    if not letter and binary:  # "24iB"
        raise memory_unit_error(text, key)
    factor = (_BINARY if binary else _DECIMAL)[letter] if letter else 1
    return int((Decimal(match.group(1)) * factor).to_integral_value())


def describe_memory_size(text: str, size: int) -> str:
    """'80GB' -> '80 GB = 74.51 GiB as written' (a decimal size shown in GiB too)."""
    match = _NUMBER_UNIT.match(str(text))
    written = f"{match.group(1)} {match.group(2)}" if match else str(text)
    if match and match.group(2)[1:2].lower() == "i":
        return f"{written} as written"
    return f"{written} = {format_bytes(size)} as written"


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
