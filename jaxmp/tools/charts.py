"""PNG charts for ``jaxmp bench`` and ``jaxmp report`` (matplotlib, the optional ``report`` extra).

Figures are built with matplotlib's object API (``Figure`` + the Agg canvas), never ``pyplot``,
so drawing a chart changes no global backend or state of a notebook that calls us. Files are
written atomically.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxmp._util.io import atomic_write
from jaxmp.errors import MissingDependency

INSTALL_HINT = "pip install 'jaxmp[report]'"
# One colour per series, the same in every chart (matplotlib's default cycle).
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf")


def figure(what: str, width: float = 8.0, height: float = 4.5) -> Any:
    """A new matplotlib Figure, or a one-line error naming the extra that installs it."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingDependency(f"{what} needs matplotlib, which is not installed: "
                                f"{INSTALL_HINT}") from None
    return Figure(figsize=(width, height), layout="constrained")


def save(fig: Any, path: str | os.PathLike) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return atomic_write(path, buf.getvalue())


def stacked_pairs(path: str | os.PathLike, title: str, ylabel: str, groups: Sequence[str],
                  measured: Mapping[str, Sequence[float | None]],
                  predicted: Mapping[str, Sequence[float | None]],
                  scale: tuple[float, str] = (1.0, "")) -> Path:
    """Two stacked bars per group: measured (solid) beside predicted (hatched).

    ``measured`` / ``predicted`` map a component name to one value per group (None: no bar).
    ``scale`` divides the values and names the unit in the y label.
    """
    fig = figure("a bar chart", max(7.0, 1.3 * len(groups) + 4))
    ax = fig.subplots()
    div, unit = scale
    x = list(range(len(groups)))
    width = 0.38
    color = 0
    for offset, parts, hatch, kind in ((-width / 2, measured, "", "measured"),
                                       (width / 2, predicted, "//", "predicted")):
        bottom = [0.0] * len(groups)
        for name, values in parts.items():
            heights = [0.0 if v is None or not math.isfinite(v) else v / div for v in values]
            if not any(heights):
                continue
            ax.bar([i + offset for i in x], heights, width, bottom=bottom, hatch=hatch,
                   color=COLORS[color % len(COLORS)], edgecolor="black", linewidth=0.4,
                   label=f"{kind}: {name}")
            bottom = [b + h for b, h in zip(bottom, heights)]
            color += 1
    for i in x:  # say so where nothing was measured, rather than draw an empty slot
        if all(v is None for values in measured.values() for v in [values[i]]):
            ax.annotate("not run", (i - width / 2, 0), rotation=90, ha="center", va="bottom",
                        fontsize="small", color="gray", xytext=(0, 3),
                        textcoords="offset points")
    ax.set_xticks(x, groups, rotation=20 if len(groups) > 5 else 0)
    ax.set_ylabel(f"{ylabel} ({unit})" if unit else ylabel)
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return save(fig, path)


def lines(path: str | os.PathLike, title: str, ylabel: str,
          series: Sequence[tuple[str, Sequence[float], Sequence[float | None], str]],
          log_y: bool = False, fmt_y: Callable[[float], str] | None = None) -> Path:
    """One line per ``(label, xs, ys, style)``; style is a matplotlib line style (``-``, ``--``).

    Series of the same run share a colour: the label up to its first " (" names the run.
    """
    fig = figure("a line chart")
    ax = fig.subplots()
    runs: dict[str, str] = {}
    for label, xs, ys, style in series:
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
        if not pts:
            continue
        run = label.split(" (")[0]
        col = runs.setdefault(run, COLORS[len(runs) % len(COLORS)])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=col, label=label,
                marker="o" if len(pts) < 12 else None, markersize=3)
    if log_y:
        ax.set_yscale("log")
    if fmt_y is not None:
        from matplotlib.ticker import FuncFormatter

        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_y(v)))
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ax.lines:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return save(fig, path)
