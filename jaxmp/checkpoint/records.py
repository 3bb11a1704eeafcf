"""A state pytree ⇄ the checkpoint's pure form, and the records that describe each array.

What is stored is a *pure* nested dict of arrays keyed by the same ``/``-joined paths that
:mod:`jaxmp.sharding` uses (``params/blocks/attn/q``, ``opt_state/1/0/mu/embed``): no NNX Variables,
optax named tuples or dataclasses, so a process that never imported the model can read it.
Beside it go per-array records — shape, dtype, logical names, the saved PartitionSpec — from
which a restore derives shardings on any mesh with ``rules.logical_spec``.

Typed PRNG keys (NNX RNG streams in ``rest``) are stored as their raw ``key_data`` with the
implementation's name in the record, and wrapped again on restore.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmp import sharding
from jaxmp.errors import CheckpointError
from jaxmp.mesh import mesh_shape

SEP = "/"


@dataclass(frozen=True)
class Entry:
    """One array of a state: its path, value (array or ShapeDtypeStruct) and logical names."""

    path: str
    value: Any
    names: tuple[str | None, ...] | None
    rows: tuple[int, ...] | None = None  # padded stage layout: each layer's flat padded row


def entries(tree: Any, path_rules: Sequence | None = None,
            names: Mapping[str, Sequence[str | None] | None] | None = None) -> list[Entry]:
    """Flatten ``tree`` (an NNX module or state, a TrainState, any pytree) into entries.

    Paths and names come from :func:`jaxmp.sharding.tree_leaves`, so they are exactly the ones the
    sharding rules see; values are the leaves inside the Variables, in the same order. ``names``
    (path → logical names) fills in names for plain arrays, e.g. a tree ``restore`` returned.
    """
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    leaves, _ = sharding.tree_leaves(tree, path_rules)
    values = jax.tree_util.tree_leaves(tree)
    if len(values) != len(leaves):  # a Variable holding a nested pytree: not a state we store
        raise CheckpointError(f"cannot checkpoint this tree: {len(leaves)} variables hold "
                              f"{len(values)} arrays (each variable must hold one array)")
    paths = [leaf.path for leaf in leaves]
    dupes = {p for p in paths if paths.count(p) > 1}
    if dupes:
        raise CheckpointError(f"cannot checkpoint this tree: path {sorted(dupes)[0]!r} is not "
                              f"unique")
    names = names or {}
    out = []
    for leaf, v in zip(leaves, values):
        given = names.get(leaf.path, leaf.names) if leaf.names is None else leaf.names
        out.append(Entry(leaf.path, v, tuple(given) if given is not None else None, leaf.rows))
    return out


def is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def stored_value(x: Any) -> Any:
    """What goes on disk for one leaf: typed keys become their uint32 key data."""
    return jax.random.key_data(x) if is_key(x) else x


def spec_to_json(spec: PartitionSpec | None) -> list | None:
    if spec is None:
        return None
    return [list(e) if isinstance(e, tuple) else e for e in sharding.normalize_spec(spec)]


def spec_from_json(spec: Sequence | None) -> PartitionSpec:
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in spec or ()])


def record(entry: Entry) -> dict[str, Any]:
    """The JSON record of one array: what a restore on another mesh (or a person) needs."""
    x = entry.value
    stored = jax.eval_shape(stored_value, x) if is_key(x) else x
    sharding = getattr(x, "sharding", None)
    rec = {"shape": [int(d) for d in np.shape(stored)], "dtype": str(np.dtype(stored.dtype)),
           "names": list(entry.names) if entry.names is not None else None,
           "spec": spec_to_json(sharding.spec) if isinstance(sharding, NamedSharding) else None,
           "bytes": math.prod(np.shape(stored)) * np.dtype(stored.dtype).itemsize}
    if is_key(x):
        rec["prng_impl"] = key_impl_name(x)
    if entry.rows is not None:
        rec["rows"] = list(entry.rows)
    return rec


def key_impl_name(x: Any) -> str:
    """The PRNG implementation of a typed key, concrete or abstract (``ShapeDtypeStruct``).

    ``jax.random.key_impl`` only takes concrete keys; an abstract key (what the trainer sees
    before it initialises) carries its implementation in its dtype.
    """
    if isinstance(x, jax.Array):
        return str(jax.random.key_impl(x))
    impl = getattr(x.dtype, "_impl", None)
    if impl is None:  # pragma: no cover - a future jax without the attribute
        return str(jax.random.key_impl(jax.random.key(0)))
    return str(getattr(impl, "name", impl))


def saved_mesh(values: Sequence[Any]) -> dict[str, int] | None:
    """Axis sizes of the mesh the arrays live on (the first NamedSharding found)."""
    for x in values:
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return mesh_shape(sharding.mesh)
    return None


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` → ``{"a": {"b": x}}``."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, last = path.split(SEP)
        node = out
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise CheckpointError(f"path {path!r} runs through an array")
        node[last] = value
    return out


def flat_paths(nested: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Inverse of :func:`nest`."""
    out: dict[str, Any] = {}
    for key, value in nested.items():
        path = f"{prefix}{SEP}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flat_paths(value, path))
        else:
            out[path] = value
    return out


def to_pure(items: Sequence[Entry]) -> dict[str, Any]:
    """The nested dict that Orbax writes."""
    return nest({e.path: stored_value(e.value) for e in items})


def target(records: Mapping[str, Mapping[str, Any]],
           shardings: Mapping[str, jax.sharding.Sharding]) -> dict[str, Any]:
    """Abstract restore target (nested ShapeDtypeStructs carrying the new shardings)."""
    return nest({p: jax.ShapeDtypeStruct(tuple(records[p]["shape"]), np.dtype(records[p]["dtype"]),
                                         sharding=s) for p, s in shardings.items()})


def rewrap(flat: Mapping[str, Any], records: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Turn stored key data back into typed keys where the record says so."""
    return {p: jax.random.wrap_key_data(x, impl=records[p]["prng_impl"])
            if records.get(p, {}).get("prng_impl") else x for p, x in flat.items()}


def shardings_on(records: Mapping[str, Mapping[str, Any]], mesh: jax.sharding.Mesh,
                 rules: Sequence) -> dict[str, NamedSharding]:
    """Each stored array's sharding on ``mesh``: its logical names resolved by ``rules``."""
    out = {}
    for path, rec in records.items():
        names, shape = rec.get("names"), rec["shape"]
        if names is None or not shape:
            spec = PartitionSpec()
        else:
            names = list(names) + [None] * (len(shape) - len(names))  # key data's extra dim
            spec = sharding.logical_spec(names, shape, mesh, rules)
        out[path] = NamedSharding(mesh, spec)
    return out


def rebuild(template: Any, flat: Mapping[str, Any], path_rules: Sequence | None = None) -> Any:
    """Put restored arrays back into the structure of ``template`` (e.g. a TrainState)."""
    paths = [e.path for e in entries(template, path_rules)]
    treedef = jax.tree_util.tree_structure(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[p] for p in paths])


def mismatch(stored: Mapping[str, Mapping[str, Any]], expected: Mapping[str, Mapping[str, Any]],
             ) -> str | None:
    """First difference between two record sets (paths, shapes, dtypes) as a phrase, or None.

    Layer stacks compare in the plain layout, so a pipelined checkpoint fits an unpipelined run
    (or another split) of the same model."""
    stored = {p: plain_record(r) for p, r in stored.items()}
    expected = {p: plain_record(r) for p, r in expected.items()}
    missing = [p for p in expected if p not in stored]
    extra = [p for p in stored if p not in expected]
    if missing or extra:
        parts = [f"{len(paths)} {what} (e.g. {next((p for p in paths if 'params' in p), paths[0])})"
                 for paths, what in ((missing, "arrays of the model are not in the checkpoint"),
                                     (extra, "arrays of the checkpoint are not in the model"))
                 if paths]
        return "; ".join(parts)
    for path, rec in expected.items():
        for key in ("shape", "dtype"):
            if key == "shape" and _replica_resize(stored[path], rec):
                continue
            if stored[path][key] != rec[key]:  # both JSON-shaped: lists and strings
                return (f"{path} has {key} {stored[path][key]} in the checkpoint but "
                        f"{rec[key]} in the model")
    return None


# ---------------------------------------------------------------------------------------------
# Layer stacks stored padded over pipeline stages ("rows" in the record) ⇄ the plain layout.


def plain_record(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The record an array has in the plain layout: ``[P, V·Lmax, ...]`` with ``rows`` becomes
    ``[L, ...]`` named like the stack without its ``stage`` dim; other records are unchanged."""
    rows = rec.get("rows")
    if rows is None:
        return dict(rec)
    shape = [len(rows)] + list(rec["shape"][2:])
    names = rec.get("names")
    item = np.dtype(rec["dtype"]).itemsize
    return {**{k: v for k, v in rec.items() if k != "rows"}, "shape": shape,
            "names": list(names[1:]) if names else None, "spec": None,
            "bytes": math.prod(shape) * item}


def to_plain(x: jax.Array, rows: Sequence[int]) -> jax.Array:
    """``[P, V·Lmax, ...]`` padded stack → ``[L, ...]`` (layer i = flat padded row rows[i])."""
    flat = x.reshape((-1,) + x.shape[2:])
    return jnp.take(flat, jnp.asarray(np.asarray(rows)), axis=0)


def plain_numpy(a: np.ndarray, rec: Mapping[str, Any]) -> np.ndarray:
    """A host array stored as ``rec`` describes it, in the plain layout (:func:`to_plain`)."""
    rows = rec.get("rows")
    return a if rows is None else a.reshape((-1,) + a.shape[2:])[np.asarray(rows)]


def to_padded(x: jax.Array, rows: Sequence[int], shape: Sequence[int]) -> jax.Array:
    """``[L, ...]`` → the padded stack of ``shape`` (zeros in padding rows)."""
    flat = jnp.zeros((shape[0] * shape[1],) + tuple(shape[2:]), x.dtype)
    return flat.at[jnp.asarray(np.asarray(rows))].set(x).reshape(tuple(shape))


# Per-replica state (first logical name "data": error-feedback residuals, one per data replica)
# saved on one data size and resumed on another.
REPLICA = "data"


def _replica_resize(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether ``stored`` is per-replica state of another replica count than ``wanted``
    (same per-replica shape)."""
    names, shape = stored.get("names") or [None], stored["shape"]
    return (names[0] == REPLICA and (wanted.get("names") or [None])[0] == REPLICA
            and shape[1:] == wanted["shape"][1:] and shape[0] != wanted["shape"][0])


def resize_replicas(x: jax.Array, replicas: int) -> jax.Array:
    """``[n, ...]`` per-replica residuals → ``[replicas, ...]`` with the same sum, spread
    evenly: the reduction sums the replicas' (pre-weighted) residuals, so what it still owes
    the gradient — their sum — is carried over whole."""
    total = jnp.sum(x, axis=0, keepdims=True)
    return jnp.broadcast_to(total / replicas, (replicas,) + x.shape[1:]).astype(x.dtype)


def convert(x: jax.Array, stored: Mapping[str, Any], wanted: Mapping[str, Any],
            placement: jax.sharding.Sharding) -> jax.Array:
    """``x`` (restored as ``stored`` describes it) in the layout ``wanted`` describes, placed
    with ``sharding``: plain ⇄ padded, padded with one split ⇄ padded with another, or
    per-replica state over another data size."""
    def change(a: jax.Array) -> jax.Array:
        if _replica_resize(stored, wanted):
            return resize_replicas(a, wanted["shape"][0])
        if stored.get("rows") is not None:
            a = to_plain(a, stored["rows"])
        if wanted.get("rows") is not None:
            a = to_padded(a, wanted["rows"], wanted["shape"])
        return a

    return jax.jit(change, out_shardings=placement)(x)


def needs_conversion(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    return stored.get("rows") != wanted.get("rows") or stored["shape"] != wanted["shape"]
