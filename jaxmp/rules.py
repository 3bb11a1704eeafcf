"""Logical axis names → mesh partition specs, for parameters and activations.

Model code names array dimensions logically (``("embed", "mlp")``) and never mentions a mesh
axis; this module is the one place that maps those names onto the mesh axes ``data``,
``stage``, ``fsdp`` and ``tensor`` (see :mod:`jaxmp.mesh`).

Resolution is an ordered rule list where the *first free match wins*, as in Linen and MaxText,
except that a logical name may appear in several rules which are tried in turn: a mesh axis
that is missing, of size 1, already used by another dimension of the same array, or that does
not divide the dimension is skipped and the next rule for that name gets its chance. (Flax
NNX's dict-based rules keep only the last rule per name, so they cannot express fallbacks.)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import jax
import numpy as np
from flax import nnx
from flax.core import meta as linen_meta
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmp.mesh import mesh_shape

if TYPE_CHECKING:
    from jaxmp.lint import LintReport

Axes = Union[str, tuple[str, ...], None]
Rule = tuple[str, Axes]
Names = tuple[Union[str, None], ...]
PathRule = tuple[str, Names]

# Order matters: for each dimension the first rule whose mesh axes are still free wins.
DEFAULT_RULES: tuple[Rule, ...] = (
    # Activations. The batch is split over data *and* fsdp (ZeRO: fsdp devices hold different
    # examples and only gather parameters); the residual stream stays replicated over tensor so
    # that only the Megatron-style inner dims (mlp, heads, vocab) are split.
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_vocab", "tensor"),
    # Parameters, primary placement: tensor parallelism on the wide inner dims, fsdp on the
    # model dim, so an ("embed", "mlp") kernel is split both ways on a 2-D mesh.
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", "fsdp"),  # ZeRO-3 shards even small vectors: per-device state is exactly total / N
    ("layers", None),  # stacked-layers axis: scanned over, so every device needs every layer
    ("stage", "stage"),  # pipeline-stage axis of stacked layer params
    # Fallbacks, tried only when the rules above left the dim unassigned: with no tensor axis,
    # or when embed does not divide by fsdp, the big matrices still shard their other dim.
    ("mlp", "fsdp"),
    ("heads", "fsdp"),
    ("kv_heads", "fsdp"),
    ("vocab", "fsdp"),
)

# Where flax keeps logical names in Variable metadata, newest first (0.12: out_sharding).
_METADATA_KEYS = ("out_sharding", "sharding_names", "sharding")


@dataclass(frozen=True)
class Fallback:
    """A mesh axis skipped only because its size does not divide the dimension (for lint)."""

    path: str
    dim: int
    logical: str
    mesh_axis: str
    axis_size: int
    dim_size: int


@dataclass(frozen=True)
class Resolution:
    """The spec of one array plus what lint needs to explain it."""

    spec: P
    fired: frozenset[int]  # rule indices that assigned an axis or replicated a dim
    considered: frozenset[int]  # rule indices that saw an unassigned dim with their name
    fallbacks: tuple[Fallback, ...]


@dataclass(frozen=True)
class Leaf:
    """One array of a tree: its path, shape, size and logical names (None: unnamed)."""

    path: str
    shape: tuple[int, ...]
    nbytes: int
    names: Names | None


def normalize_rules(rules: Sequence[Sequence[Any]]) -> tuple[Rule, ...]:
    """Turn rules (possibly lists, e.g. from TOML) into hashable ``(name, axes)`` pairs."""
    out: list[Rule] = []
    for rule in rules:
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise ValueError(f"a rule is (logical_name, mesh_axes), got {rule!r}")
        name, axes = rule
        if axes is None or isinstance(axes, str):
            out.append((name, axes))
        elif isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes):
            out.append((name, tuple(axes)))
        else:
            raise ValueError(
                f"rule {name!r}: mesh axes must be str, tuple of str or None, got {axes!r}")
    return tuple(out)


def normalize_spec(entries: Sequence[Any]) -> P:
    """PartitionSpec without trailing Nones, because ``P('a', None) != P('a')``."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def resolve(names: Names, shape: Sequence[int], mesh_sizes: dict[str, int],
            rules: Sequence[Rule], path: str = "") -> Resolution:
    """Apply ordered rules to one array (first free match wins; see module docstring)."""
    unset = object()
    assigned: list[Any] = [unset] * len(names)
    used: set[str] = set()
    fired: set[int] = set()
    considered: set[int] = set()
    fallbacks: list[Fallback] = []
    for idx, (logical, axes) in enumerate(rules):
        for i, name in enumerate(names):
            if name != logical or assigned[i] is not unset:
                continue
            considered.add(idx)
            if axes is None:  # explicit replication: the dim is settled, later rules don't apply
                assigned[i] = None
                fired.add(idx)
                continue
            chosen: list[str] = []
            for ax in (axes,) if isinstance(axes, str) else axes:
                size = mesh_sizes.get(ax, 1)
                if size == 1 or ax in used or ax in chosen:
                    continue
                if shape[i] % (math.prod(mesh_sizes[a] for a in chosen) * size):
                    fallbacks.append(Fallback(path, i, logical, ax, size, int(shape[i])))
                    continue
                chosen.append(ax)
            if chosen:
                assigned[i] = chosen[0] if len(chosen) == 1 else tuple(chosen)
                used.update(chosen)
                fired.add(idx)
    spec = normalize_spec(None if a is unset else a for a in assigned)
    return Resolution(spec, frozenset(fired), frozenset(considered), tuple(fallbacks))


def _check_rank(names: Names, shape: Sequence[int], path: str, source: str) -> None:
    if len(names) != len(shape):
        raise ValueError(
            f"{path or '<array>'}: logical names {tuple(names)} ({source}) have {len(names)} "
            f"entries but the array has shape {tuple(shape)} (rank {len(shape)})")


def logical_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Any,
                 rules: Sequence[Rule] = DEFAULT_RULES) -> P:
    """Resolve one array's logical names on ``mesh``; used for activations."""
    names = tuple(names)
    _check_rank(names, shape, "", "logical_spec")
    return resolve(names, tuple(shape), mesh_shape(mesh), normalize_rules(rules)).spec


# ---------------------------------------------------------------------------------------------
# Trees: NNX modules / states, Linen boxed params, plain pytrees.


def _is_leaf(x: Any) -> bool:
    # Variables and Linen boxes carry the names; stopping there also makes every output tree a
    # pytree prefix of the state (a spec where each Variable was).
    return isinstance(x, (nnx.Variable, linen_meta.AxisMetadata))


def _key_str(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _as_names(value: Any, where: str) -> Names | None:
    if value is None or isinstance(value, (str, jax.sharding.Sharding)):
        return None  # absent, or a concrete sharding rather than logical names
    try:
        names = tuple(value)
    except TypeError:
        return None
    if not all(n is None or isinstance(n, str) for n in names):
        raise ValueError(f"{where}: logical names must be str or None, got {value!r}")
    return names


def _unbox(x: Any, path: str) -> tuple[Any, Names | None, str]:
    """The array inside a leaf, the names in its metadata, and where they came from."""
    if isinstance(x, nnx.Variable):
        value = x.get_value() if hasattr(x, "get_value") else x.value
        md = x.get_metadata() if hasattr(x, "get_metadata") else getattr(x, "_var_metadata", {})
        for key in _METADATA_KEYS:
            names = _as_names(md.get(key), f"{path} (metadata {key!r})")
            if names is not None:
                return value, names, f"Variable metadata {key!r}"
        return value, None, ""
    if isinstance(x, linen_meta.AxisMetadata):
        names = _as_names(getattr(x, "names", None), f"{path} (Linen box)")
        # .value, not .unbox(): Partitioned.unbox() may apply a sharding constraint.
        return getattr(x, "value", x), names, "Linen box names"
    return x, None, ""


def _nbytes(value: Any, shape: tuple[int, ...]) -> int:
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        dtype = np.asarray(value).dtype
    return math.prod(shape) * int(dtype.itemsize)


def _compile_path_rules(
        path_rules: Sequence[PathRule] | None) -> list[tuple[re.Pattern, Names, str]]:
    out = []
    for pattern, names in path_rules or ():
        checked = _as_names(names, f"path rule {pattern!r}")
        if checked is None:
            raise ValueError(f"path rule {pattern!r}: names must be a tuple, got {names!r}")
        out.append((re.compile(pattern), checked, pattern))
    return out


def tree_leaves(tree: Any, path_rules: Sequence[PathRule] | None = None) -> tuple[list[Leaf], Any]:
    """Flatten ``tree`` into :class:`Leaf` records and the treedef to rebuild output trees.

    A matching path rule wins over metadata (an explicit user override); scalars are always
    replicated so broad regexes cannot trip over step counters.
    """
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    compiled = _compile_path_rules(path_rules)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    leaves = []
    for keys, x in flat:
        path = "/".join(_key_str(k) for k in keys)
        value, names, source = _unbox(x, path)
        for regex, rule_names, pattern in compiled:
            if regex.search(path):
                names, source = rule_names, f"path rule {pattern!r}"
                break
        shape = tuple(int(d) for d in np.shape(value))
        if not shape:
            names = None
        elif names is not None:
            _check_rank(names, shape, path, source)
        leaves.append(Leaf(path, shape, _nbytes(value, shape), names))
    return leaves, treedef


def resolve_leaves(leaves: Sequence[Leaf], mesh: Any, rules: Sequence[Rule]) -> list[Resolution]:
    """Resolve every leaf (unnamed leaves are replicated) on ``mesh``."""
    sizes, rules = mesh_shape(mesh), normalize_rules(rules)
    empty = Resolution(P(), frozenset(), frozenset(), ())
    return [resolve(leaf.names, leaf.shape, sizes, rules, leaf.path) if leaf.names is not None
            else empty for leaf in leaves]


def logical_names(tree: Any, path_rules: Sequence[PathRule] | None = None) -> Any:
    """Tree (structure of :func:`specs_for`'s output) of each array's names tuple or None.

    Note the names tuples are themselves pytree nodes; map over this tree with
    ``is_leaf=lambda x: isinstance(x, tuple)`` (checkpoints store these beside the arrays).
    """
    leaves, treedef = tree_leaves(tree, path_rules)
    return jax.tree_util.tree_unflatten(treedef, [leaf.names for leaf in leaves])


def specs_for(tree: Any, mesh: Any, rules: Sequence[Rule] = DEFAULT_RULES,
              path_rules: Sequence[PathRule] | None = None) -> Any:
    """Tree of PartitionSpec, one where each array / Variable of ``tree`` was."""
    leaves, treedef = tree_leaves(tree, path_rules)
    specs = [r.spec for r in resolve_leaves(leaves, mesh, rules)]
    return jax.tree_util.tree_unflatten(treedef, specs)


def shardings_for(tree: Any, mesh: Mesh, rules: Sequence[Rule] = DEFAULT_RULES,
                  path_rules: Sequence[PathRule] | None = None) -> Any:
    """Tree of NamedSharding; a valid ``jax.jit(out_shardings=...)`` prefix for the state."""
    leaves, treedef = tree_leaves(tree, path_rules)
    return jax.tree_util.tree_unflatten(
        treedef, [NamedSharding(mesh, r.spec) for r in resolve_leaves(leaves, mesh, rules)])


def lint(tree: Any, mesh: Any, rules: Sequence[Rule] = DEFAULT_RULES,
         path_rules: Sequence[PathRule] | None = None) -> LintReport:
    """How well ``tree`` shards on ``mesh``; see :mod:`jaxmp.lint` (lazy import: it imports us)."""
    from jaxmp.lint import lint as _lint

    return _lint(tree, mesh, rules, path_rules)


def __getattr__(name: str) -> Any:
    if name == "LintReport":  # re-export without a circular import at module load
        from jaxmp.lint import LintReport

        return LintReport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# Activations: model code calls constrain(x, names); the trainer decides whether it means anything.

_ACTIVE: contextvars.ContextVar[tuple[Any, tuple[Rule, ...]] | None] = contextvars.ContextVar(
    "jaxmp_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Sequence[Rule] = DEFAULT_RULES) -> Iterator[None]:
    """Make :func:`constrain` apply sharding constraints on ``mesh`` while tracing inside.

    The context is read at trace time and is not part of jit's cache key: enter it around the
    first call (trace) of a jitted function, not around a later cached call.
    """
    token = _ACTIVE.set((mesh, normalize_rules(rules)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: Any, names: Sequence[str | None]) -> Any:
    """Constrain activation ``x`` by logical names; identity outside :func:`activation_sharding`.

    Keeps model code runnable on one device and in tests without any mesh.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_spec(names, np.shape(x), mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
