"""How jaxmp prints numbers, meshes and tables, so every command shows them the same way."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_bytes(n: float, digits: int = 2) -> str:
    """``1536`` → ``"1.50 KiB"``; whole bytes below 1 KiB (``"12 B"``)."""
    value = float(n)
    for unit in _BYTE_UNITS:
        if abs(value) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{value:.0f} B" if unit == "B" else f"{value:.{digits}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_time(seconds: float) -> str:
    """Milliseconds below a second, seconds below an hour (``"12.3 ms"``, ``"4.56 s"``)."""
    if seconds != seconds:  # NaN
        return "n/a"
    if abs(seconds) < 1:
        return f"{seconds * 1e3:.3g} ms"
    if abs(seconds) < 3600:
        return f"{seconds:.3g} s"
    return f"{seconds / 3600:.3g} h"


def fmt_flops(flops: float) -> str:
    """``3.2e15`` → ``"3.20 PFLOP"``: large counts stay readable in a table column."""
    for unit, size in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9),
                       ("MFLOP", 1e6)):
        if abs(flops) >= size:
            return f"{flops / size:.2f} {unit}"
    return f"{flops:.0f} FLOP"


def mesh_str(sizes: Mapping[str, int]) -> str:
    """``{"data": 2, "stage": 1, "fsdp": 4}`` → ``"data=2 x fsdp=4"`` (axes of size 1 omitted)."""
    return " x ".join(f"{k}={v}" for k, v in sizes.items() if v != 1) or "single device"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], right: frozenset[int] | set[int]
          = frozenset(), indent: str = "  ", limit: int | None = None) -> list[str]:
    """A fixed-width text table as lines; columns in ``right`` (numbers) are right-aligned.

    With ``limit``, at most that many rows are shown, then a line saying how many more exist.
    """
    shown = [[str(c) for c in row] for row in (rows[:limit] if limit is not None else rows)]
    widths = [max([len(h)] + [len(r[i]) for r in shown]) for i, h in enumerate(header)]

    def fmt(cells: Sequence[str]) -> str:
        return indent + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [fmt(header), indent + "  ".join("-" * w for w in widths)]
    out += [fmt(r) for r in shown]
    if limit is not None and len(rows) > limit:
        out.append(f"{indent}... and {len(rows) - limit} more")
    return out


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]],
             right: frozenset[int] | set[int] = frozenset()) -> list[str]:
    """A Markdown table as lines, padded so it also reads as plain text in a terminal."""
    cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]

    def fmt(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(row, widths))) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if i in right else "-" * (w + 2)
                          for i, w in enumerate(widths)) + "|"
    return [fmt(header), rule] + [fmt(r) for r in cells]
