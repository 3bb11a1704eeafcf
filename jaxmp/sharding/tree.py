"""Logical names of every array in a tree, and the tree's specs and shardings on a mesh.

A tree is an NNX module or state, Linen boxed params, or any pytree of arrays /
``ShapeDtypeStruct``. Names come from NNX Variable metadata (:func:`names_of`), Linen boxes, or
regex *path rules* over the ``/``-joined path — both end in the same resolution
(:func:`jaxmp.sharding.resolve.resolve`). Variables and boxes are leaves here, so every output
tree is a pytree prefix of the input (a spec where each Variable was).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.core import meta as linen_meta
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmp._util.arrays import nbytes
from jaxmp.mesh import mesh_shape
from jaxmp.sharding.resolve import (DEFAULT_RULES, Names, PathRule, Resolution, Rule,
                                    fit_names, normalize_rules, resolve)

# Where flax keeps logical names in Variable metadata, newest first (0.12: out_sharding).
METADATA_KEYS = ("out_sharding", "sharding_names", "sharding")
ROWS_KEY = "stage_rows"  # Variable metadata of a layer stack stored padded over stages


def without_eager_sharding() -> Any:
    """A context in which NNX models are built with their names as metadata only.

    Flax 0.12 shards an annotated Variable as it is created ("eager sharding"), which needs a
    mesh whose axes *are* the names. jaxmp resolves logical names itself, so every place that
    builds a model (abstractly or for real) does it inside this context; the Variables remember
    ``eager_sharding=False``, so later splits and merges need nothing more.
    """
    return nnx.use_eager_sharding(False)


def abstract(model_fn: Callable[[], Any]) -> Any:
    """``nnx.eval_shape(model_fn)`` with eager sharding off: an abstract model (shapes and
    names, no memory) to hand to :func:`specs_for`, :func:`shardings_for` or :func:`lint`."""
    with without_eager_sharding():
        return nnx.eval_shape(model_fn)


@dataclass(frozen=True)
class Leaf:
    """One array of a tree: its path, shape, size and logical names (None: unnamed)."""

    path: str
    shape: tuple[int, ...]
    nbytes: int
    names: Names | None  # padded to the rank
    given: int = 0  # how many names were given (fewer than dims: the rest replicated)
    # A stacked layer axis stored padded over pipeline stages: the flat padded row of each
    # layer (Variable metadata ROWS_KEY), so a checkpoint can restore the plain layout.
    rows: tuple[int, ...] | None = None


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


def names_of(variable: nnx.Variable, where: str = "") -> tuple[Names | None, str]:
    """The logical names in an NNX Variable's metadata and the metadata key they came from.

    Flax has moved them between keys (0.12: ``out_sharding``); every reader of names in jaxmp
    goes through here.
    """
    md = variable.get_metadata() if hasattr(variable, "get_metadata") else \
        getattr(variable, "_var_metadata", {})
    for key in METADATA_KEYS:
        names = _as_names(md.get(key), f"{where} (metadata {key!r})")
        if names is not None:
            return names, key
    return None, ""


def unbox(x: Any, path: str = "") -> tuple[Any, Names | None, str]:
    """The array inside a leaf, the names in its metadata, and where they came from."""
    if isinstance(x, nnx.Variable):
        value = x.get_value() if hasattr(x, "get_value") else x.value
        names, key = names_of(x, path)
        return value, names, f"Variable metadata {key!r}" if names is not None else ""
    if isinstance(x, linen_meta.AxisMetadata):
        names = _as_names(getattr(x, "names", None), f"{path} (Linen box)")
        # .value, not .unbox(): Partitioned.unbox() may apply a sharding constraint.
        return getattr(x, "value", x), names, "Linen box names"
    return x, None, ""


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
        value, names, source = unbox(x, path)
        for regex, rule_names, pattern in compiled:
            if regex.search(path):
                names, source = rule_names, f"path rule {pattern!r}"
                break
        shape = tuple(int(d) for d in np.shape(value))
        given = len(names) if names is not None and shape else 0
        if not shape:
            names = None
        elif names is not None:
            names = fit_names(names, shape, path, source)
        rows = x.get_metadata().get(ROWS_KEY) if isinstance(x, nnx.Variable) else None
        leaves.append(Leaf(path, shape, nbytes(value), names, given,
                           tuple(rows) if rows is not None else None))
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
