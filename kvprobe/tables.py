"""Plain-text tables a person reads at a glance (ledger, probe report, plugin summary).

Cells are rendered as: ``None`` -> ``-``, ``bool`` -> ``yes``/``no``, ``int`` -> thousands
separators, ``float`` -> up to 4 significant decimals without trailing zeros, anything else
``str()``. Columns whose cells are all numbers (or ``-``) are right-aligned unless ``align`` says
otherwise.
"""

from __future__ import annotations

import re

_NUMERIC = re.compile(r"^[-+]?[0-9][0-9,]*(\.[0-9]+)?(e[-+]?[0-9]+)?[x%]?$")


def format_cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:  # NaN
            return "nan"
        if value == int(value) and abs(value) < 1e15:
            return f"{int(value):,}"
        return f"{value:,.4f}".rstrip("0").rstrip(".")
    return str(value)


def _looks_numeric(cell: str) -> bool:
    return cell == "-" or bool(_NUMERIC.match(cell))


def render_table(
    headers: list[str],
    rows: list[list[object]],
    *,
    title: str | None = None,
    align: str | None = None,
) -> str:
    """Monospace table; `align` is one letter per column ('l', 'r' or 'c') when given."""
    ncols = len(headers)
    for i, row in enumerate(rows):
        if len(row) != ncols:
            raise ValueError(f"row {i} has {len(row)} cells, the table has {ncols} columns")
    if align is not None and (len(align) != ncols or set(align) - set("lrc")):
        raise ValueError(f"align must be {ncols} letters of l/r/c, got {align!r}")
    cells = [[format_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[c]) for r in cells]) for c, h in enumerate(headers)]
    if align is None:
        align = "".join(
            "r" if cells and all(_looks_numeric(r[c]) for r in cells) else "l" for c in range(ncols)
        )

    def line(parts: list[str]) -> str:
        out = []
        for c, part in enumerate(parts):
            how = align[c]
            if how == "r":
                out.append(part.rjust(widths[c]))
            elif how == "c":
                out.append(part.center(widths[c]))
            else:
                out.append(part.ljust(widths[c]))
        return "  ".join(out).rstrip()

    lines = []
    if title:
        lines.append(title)
    lines.append(line(list(headers)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(line(r) for r in cells)
    return "\n".join(lines)
