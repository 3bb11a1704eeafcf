"""Sharding lint: how far a tree's per-device bytes are from ideal, and why.

Rules fail silently by design (an axis that does not fit is skipped, an unknown name is
replicated), so this report is where those silent choices become visible: the arrays left
whole on every device, the rules that never did anything, the names no rule knows, and the
dims that fell back because a mesh axis did not divide them. ``jaxmp.rules`` re-exports
:func:`lint`.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from jax.sharding import PartitionSpec as P

from jaxmp._util.fmt import fmt_bytes, mesh_str, table
from jaxmp.mesh import mesh_shape
from jaxmp.sharding.bias import SplitBias, split_biases
from jaxmp.sharding.resolve import DEFAULT_RULES, Axes, Fallback, PathRule, Rule, normalize_rules
from jaxmp.sharding.tree import resolve_leaves, tree_leaves

_SHOW = 20  # rows shown per list section in str(); to_dict() keeps everything
ABSENT = "name not in tree"


@dataclass(frozen=True)
class ArrayInfo:
    """One array as resolved: where it is, how it is named and split, what each device holds."""

    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...] | None
    spec: str
    nbytes: int
    per_device_bytes: int


@dataclass(frozen=True)
class UnusedRule:
    """A rule that assigned nothing anywhere in the tree, and the reason."""

    index: int
    logical: str
    axes: Axes
    reason: str


@dataclass
class LintReport:
    """Per-device memory versus the ideal ``total / devices``, with the causes of any gap."""

    mesh: dict[str, int]
    total_bytes: int
    per_device_bytes: int
    ideal_bytes: float
    ratio: float
    replicated: list[tuple[str, int]]  # (path, bytes) of arrays using no mesh axis, largest first
    replicated_bytes: int
    unused_rules: list[UnusedRule]
    unknown_names: list[str]
    fallbacks: list[Fallback]
    arrays: list[ArrayInfo] = field(default_factory=list)
    # (path, names given, rank) of arrays named on fewer dims than they have
    partial: list[tuple[str, int, int]] = field(default_factory=list)
    # biases split over an axis their kernel's output dim is not (sharding/bias.py)
    split_biases: list[SplitBias] = field(default_factory=list)

    @property
    def shards(self) -> int:
        """Devices the params are meant to be split over: every axis but ``data``, whose
        replicas hold the same params by design (data parallelism)."""
        return math.prod(v for k, v in self.mesh.items() if k != "data")

    @property
    def shard_ratio(self) -> float:
        """Per-device bytes over ``total / shards``: 1.0 when every array splits evenly."""
        return self.per_device_bytes * self.shards / self.total_bytes if self.total_bytes else 1.0

    def summary(self) -> str:
        """One line: per-device bytes against the ideal, and what stays replicated."""
        return (f"{fmt_bytes(self.total_bytes)}, {fmt_bytes(self.per_device_bytes)} per device = "
                f"{self.shard_ratio:.2f}x total/{self.shards}; {fmt_bytes(self.replicated_bytes)} "
                f"in {len(self.replicated)} array(s) replicated")

    def warning(self, threshold: float = 1.5) -> str | None:
        """A one-line warning when per-device bytes exceed ``threshold`` x ``total / shards``,
        naming the largest replicated arrays and the names no rule knows, or when a bias is
        split where its kernel's output is not (None: nothing to say)."""
        biases = [b.message() for b in self.split_biases]
        more = [f"and {len(biases) - 1} more such bias(es)"] if len(biases) > 1 else []
        return "; ".join([*self._memory_warning(threshold), *biases[:1], *more]) or None

    def _memory_warning(self, threshold: float) -> list[str]:
        if self.shard_ratio <= threshold:
            return []
        largest = ", ".join(f"{p} ({fmt_bytes(b)})" for p, b in self.replicated[:3])
        unknown = (f"; names no rule knows: {', '.join(self.unknown_names)}"
                   if self.unknown_names else "")
        return [f"params take {self.shard_ratio:.2f}x total/{self.shards} per device: largest "
                f"replicated arrays {largest or 'none'}{unknown} (add rules or path_rules)"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (tuples become lists) for ``--json`` output and plan files."""
        d = asdict(self)
        d["replicated"] = [{"path": p, "bytes": b} for p, b in self.replicated]
        return d

    def __str__(self) -> str:
        n_dev = math.prod(self.mesh.values())
        lines = [f"sharding lint: mesh {mesh_str(self.mesh)} ({n_dev} devices), "
                 f"{len(self.arrays)} arrays", ""]
        summary = [
            ("total bytes", fmt_bytes(self.total_bytes)),
            ("per-device bytes", fmt_bytes(self.per_device_bytes)),
            ("ideal per-device (total/devices)", fmt_bytes(self.ideal_bytes)),
            ("ratio per-device / ideal", f"{self.ratio:.2f}"),
            ("bytes left replicated", f"{fmt_bytes(self.replicated_bytes)} in "
                                      f"{len(self.replicated)} array(s)"),
        ]
        lines += [f"  {k:<34}{v:>24}" for k, v in summary]
        lines += _section("Arrays", ["path", "shape", "names", "spec", "per device"], [
            [a.path, _shape(a.shape), _names(a.names), a.spec, fmt_bytes(a.per_device_bytes)]
            for a in self.arrays], right={4})
        lines += _section("Replicated arrays (largest first)", ["path", "bytes"],
                          [[p, fmt_bytes(b)] for p, b in self.replicated], right={1})
        lines += _section("Divisibility fallbacks", ["path", "dim", "logical", "mesh axis",
                                                     "axis size", "dim size"],
                          [[f.path, f.dim, f.logical, f.mesh_axis, f.axis_size, f.dim_size]
                           for f in self.fallbacks], right={1, 4, 5})
        # Rules for names absent from this tree are expected (activation rules in a param
        # tree): list them in one line so the actionable ones stand out.
        absent = [u for u in self.unused_rules if u.reason == ABSENT]
        lines += _section("Rules that never fired", ["#", "logical", "mesh axes", "why"],
                          [[u.index, u.logical, _axes(u.axes), u.reason]
                           for u in self.unused_rules if u.reason != ABSENT], right={0})
        if absent:
            lines += textwrap.wrap(
                f"+ {len(absent)} rule(s) for names not in this tree: "
                + ", ".join(f"#{u.index} {u.logical}" for u in absent),
                width=96, initial_indent="  ", subsequent_indent="    ")
        lines += _section("Logical names no rule mentions", ["name"],
                          [[n] for n in self.unknown_names])
        if self.partial:
            lines += _section("Names covering fewer dims than the array has (rest replicated)",
                              ["path", "names cover"],
                              [[p, f"{given} of {rank} dims"] for p, given, rank in self.partial])
        if self.split_biases:
            lines += ["", "Biases split where their kernel's output is not"]
            lines += [f"  {b.message()}" for b in self.split_biases[:_SHOW]]
        return "\n".join(lines)


def lint(tree: Any, mesh: Any, rules: Sequence[Rule] = DEFAULT_RULES,
         path_rules: Sequence[PathRule] | None = None) -> LintReport:
    """Resolve ``tree`` on ``mesh`` and report memory balance, replication and rule usage."""
    rules = normalize_rules(rules)
    sizes = mesh_shape(mesh)
    leaves, _ = tree_leaves(tree, path_rules)
    resolutions = resolve_leaves(leaves, mesh, rules)

    arrays = []
    for leaf, res in zip(leaves, resolutions):
        split = math.prod(sizes[a] for a in _spec_axes(res.spec))
        arrays.append(ArrayInfo(leaf.path, leaf.shape, leaf.names, _spec_str(res.spec),
                                leaf.nbytes, leaf.nbytes // split))
    total = sum(a.nbytes for a in arrays)
    per_device = sum(a.per_device_bytes for a in arrays)
    ideal = total / math.prod(sizes.values())
    replicated = sorted(((a.path, a.nbytes) for a in arrays if a.spec == "P()"),
                        key=lambda pb: -pb[1])

    present = {n for leaf in leaves for n in leaf.names or () if n is not None}
    fired = set().union(*(r.fired for r in resolutions))
    considered = set().union(*(r.considered for r in resolutions))
    unused = []
    for i, (logical, axes) in enumerate(rules):
        if i in fired:
            continue
        if logical not in present:
            reason = ABSENT
        elif i in considered:
            reason = "no usable mesh axis (absent, size 1, taken or not dividing)"
        else:
            reason = "shadowed: earlier rules settled every such dim"
        unused.append(UnusedRule(i, logical, axes, reason))

    fallbacks = list(dict.fromkeys(f for r in resolutions for f in r.fallbacks))
    return LintReport(
        mesh=sizes, total_bytes=total, per_device_bytes=per_device, ideal_bytes=ideal,
        ratio=per_device / ideal if ideal else 1.0, replicated=replicated,
        replicated_bytes=sum(b for _, b in replicated), unused_rules=unused,
        unknown_names=sorted(present - {logical for logical, _ in rules} - set(sizes)),
        fallbacks=fallbacks,
        partial=[(leaf.path, leaf.given, len(leaf.shape)) for leaf in leaves
                 if leaf.names is not None and leaf.given < len(leaf.shape)],
        arrays=arrays, split_biases=split_biases(leaves, [r.spec for r in resolutions]))


def _spec_axes(spec: P) -> list[str]:
    out: list[str] = []
    for entry in spec:
        if isinstance(entry, str):
            out.append(entry)
        elif entry is not None:
            out.extend(entry)
    return out


def _spec_str(spec: P) -> str:
    return "P(" + ", ".join(_axes(e) if e is not None else "None" for e in spec) + ")"


def _axes(axes: Axes) -> str:
    if axes is None:
        return "None"
    return repr(axes) if isinstance(axes, str) else "(" + ", ".join(map(repr, axes)) + ")"


def _names(names: tuple[str | None, ...] | None) -> str:
    return "-" if names is None else "(" + ", ".join(str(n) for n in names) + ")"


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def _section(title: str, header: list[str], rows: list[list[Any]],
             right: set[int] = frozenset()) -> list[str]:
    """A titled table (at most ``_SHOW`` rows), or "(none)"."""
    return ["", title] + (table(header, rows, right, limit=_SHOW) if rows else ["  (none)"])
