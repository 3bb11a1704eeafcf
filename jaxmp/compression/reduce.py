"""Gradient reduction over the data axis: once per step, optionally compressed.

Plain data parallelism lets XLA all-reduce every gradient as it is produced — once per
microbatch under gradient accumulation, always in float32. A :class:`Reducer` takes the
reduction over ``data`` into jaxmp's hands, in two ``jax.shard_map`` s inside the one jitted step:

1. :func:`per_replica` runs the step's gradient function once per data replica (manual over
   ``data`` only: fsdp, tensor and stage stay automatic, so XLA still shards the model inside a
   replica, gathers its weights and reduce-scatters over fsdp), accumulating microbatches
   locally; each replica's gradient comes out stacked on a leading ``data`` dim.
2. :meth:`Reducer.__call__` reduces the stack with every axis manual, so each device works on
   its own shards with explicit collectives over ``data`` (:mod:`jaxmp.compression.codecs`):
   ``none`` (float32 all-reduce), ``bfloat16``, ``int8`` (per-block scales) or ``powersgd``.

State the encodings carry between steps lives in ``TrainState.extra["grad_compression"]``
(:func:`state_extension`): error-feedback residuals, one per data replica and shaped like the
params (logical names ``("data", *param names)``), and PowerSGD's warm-start Q matrices. It is
sharded and checkpointed like the params.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxmp import sharding
from jaxmp.config import GRAD_COMPRESSIONS
from jaxmp.compression.codecs import DATA, padded_length, powersgd, two_phase_sum
from jaxmp.sharding.optimizer import data_dim

KINDS = GRAD_COMPRESSIONS
STATE_KEY = "grad_compression"
BATCH_NAMES = ("layers", "stage")  # leading dims that index independent matrices
SCALE_BYTES = 4  # one float32 scale per int8 block


@dataclass(frozen=True)
class Compression:
    """What the data-axis reduction sends (the ``[compression]`` section's gradient keys)."""

    kind: str = "none"
    error_feedback: bool = True
    block: int = 256
    rank: int = 4
    start: int = 0  # PowerSGD: steps before this one run the uncompressed program

    @classmethod
    def from_config(cls, section: Any) -> Compression:
        """From a ``[compression]`` section (:class:`jaxmp.config.CompressionConfig`)."""
        return cls(section.gradients, section.error_feedback, section.int8_block,
                   section.powersgd_rank, section.powersgd_start)

    @property
    def residual(self) -> bool:
        """Whether an error-feedback residual is kept (bf16 keeps none: its error is tiny)."""
        return self.error_feedback and self.kind in ("int8", "powersgd")

    @property
    def stateful(self) -> bool:
        return self.residual or self.kind == "powersgd"

    def warmup_steps(self) -> int:
        return self.start if self.kind == "powersgd" else 0

    def uncompressed(self) -> Compression:
        return dataclasses.replace(self, kind="none")


@dataclass(frozen=True)
class MatrixView:
    """How PowerSGD sees one parameter: ``batch`` leading dims of independent matrices, rows up
    to dim ``split``, columns from there (the split that makes the matrix squarest)."""

    batch: int
    split: int


def matrix_view(shape: Sequence[int], names: Sequence[str | None] | None,
                rank: int) -> MatrixView | None:
    """The view of a parameter PowerSGD compresses, or None when rank r would not save bytes."""
    names = tuple(names or (None,) * len(shape))
    b = 0
    while b < len(shape) and names[b] in BATCH_NAMES:
        b += 1
    dims = tuple(shape[b:])
    if len(dims) < 2:
        return None
    k = min(range(1, len(dims)), key=lambda i: math.prod(dims[:i]) + math.prod(dims[i:]))
    n, m = math.prod(dims[:k]), math.prod(dims[k:])
    return MatrixView(b, b + k) if rank * (n + m) < n * m else None


def reduced_after_microbatches(data: int, kind: str, microbatches: int, stages: int = 1
                               ) -> bool:
    """Whether the data-axis gradient reduction leaves XLA's hands and runs once per step,
    after the last microbatch: to compress it (``kind``), or to accumulate microbatches or a
    pipeline's chunks first. Otherwise XLA reduces each layer's gradients as the backward
    pass makes them. The Trainer (``train/wire.py``) and the planner both ask here."""
    return data > 1 and (kind != "none" or microbatches > 1 or stages > 1)


def bytes_factor(comp: Compression, params: Sequence[tuple[Sequence[int], Any]]) -> float:
    """Bytes the data-axis reduction sends relative to a float32 all-reduce of the same params
    (``params``: (shape, logical names) of each array). For the planner."""
    if comp.kind == "bfloat16":
        return 0.5
    if comp.kind == "int8":
        return (1 + SCALE_BYTES / comp.block) / 4
    if comp.kind != "powersgd":
        return 1.0
    full = sent = 0
    for shape, names in params:
        size = math.prod(shape)
        view = matrix_view(shape, names, comp.rank)
        full += size
        if view is None:
            sent += size
        else:
            batch, rows = math.prod(shape[:view.batch]), math.prod(shape[view.batch:view.split])
            sent += batch * comp.rank * (rows + math.prod(shape[view.split:]))
    return sent / full if full else 1.0


def without_data(rules: Sequence) -> tuple:
    """``rules`` with the ``data`` axis removed: what activations resolve to inside a replica
    (where ``data`` is a manual axis no constraint may name)."""
    out = []
    for name, axes in sharding.normalize_rules(rules):
        if axes is None:
            out.append((name, None))
            continue
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a != DATA)
        if kept:
            out.append((name, kept[0] if len(kept) == 1 else kept))
    return tuple(out)


class CompressionState(nnx.Variable):
    """An array of the reducer's state (a residual or a Q matrix), with its logical names."""


def _key(path: str) -> str:
    return path.replace("/", ".")


def _q_shape(shape: Sequence[int], view: MatrixView, rank: int) -> tuple[int, ...]:
    return tuple(shape[:view.batch]) + tuple(shape[view.split:]) + (rank,)


def state_extension(comp: Compression, replicas: int, path_rules: Sequence | None = None
                    ) -> Callable[[Any], dict]:
    """The Trainer extension building ``extra["grad_compression"]`` from the params: residuals
    ``[data, *param shape]`` named ``("data", *names)`` and PowerSGD's Q ``[*batch, *cols, r]``
    (random normal: the first warm start), named like the param's batch and column dims."""

    def make(params: Any) -> dict:
        leaves, _ = sharding.tree_leaves(params, path_rules)
        out: dict[str, dict] = {}
        if comp.residual:
            out["residual"] = {
                _key(leaf.path): CompressionState(
                    jnp.zeros((replicas,) + leaf.shape, jnp.float32),
                    out_sharding=(DATA,) + tuple(leaf.names or (None,) * len(leaf.shape)),
                    eager_sharding=False) for leaf in leaves}
        if comp.kind == "powersgd":
            qs = {}
            for i, leaf in enumerate(leaves):
                view = matrix_view(leaf.shape, leaf.names, comp.rank)
                if view is None:
                    continue
                names = tuple(leaf.names or (None,) * len(leaf.shape))
                key = jax.random.fold_in(jax.random.key(0), i)
                qs[_key(leaf.path)] = CompressionState(
                    jax.random.normal(key, _q_shape(leaf.shape, view, comp.rank), jnp.float32),
                    out_sharding=names[:view.batch] + names[view.split:] + (None,),
                    eager_sharding=False)
            out["q"] = qs
        return out

    return make


def per_replica(grad_fn: Callable, mesh: Mesh, param_shardings: Any) -> Callable:
    """``grad_fn`` (the step's contract: ``(params, rest, batch, key) -> (loss, grads, rest,
    aux)``) run once per data replica on its rows of the batch. Returns the same contract, but
    ``grads`` stacked ``[data, ...]``: replica i's gradient times its share of the step's
    tokens, so the stack sums to the step's gradient. ``aux["weight"]`` (if the inner function
    keeps it) is the replica's token count; without it replicas weigh the same. Each replica
    folds its index into the key (its dropout masks differ from the others')."""
    specs = jax.tree.leaves(param_shardings)

    def body(params: Any, rest: Any, batch: dict, key: jax.Array) -> tuple:
        key = jax.random.fold_in(key, jax.lax.axis_index(DATA))
        loss, grads, rest, aux = grad_fn(params, rest, batch, key)
        aux = dict(aux)
        weight = jnp.asarray(aux.pop("weight", 1.0), jnp.float32)
        share = weight / jax.lax.psum(weight, DATA)
        loss = jax.lax.psum(loss * share, DATA)
        flat, treedef = jax.tree.flatten(grads)
        flat = [jax.lax.with_sharding_constraint(g * share.astype(g.dtype),
                                                 sharding.named(mesh, s.spec))[None]
                for g, s in zip(flat, specs, strict=True)]
        aux = jax.tree.map(lambda a: jax.lax.pmean(a, DATA), aux)
        return loss, jax.tree.unflatten(treedef, flat), rest, aux

    run = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(DATA), P()),
                        out_specs=(P(), P(DATA), P(), P()), axis_names=frozenset({DATA}),
                        check_vma=False)

    def replicated(params: Any, rest: Any, batch: dict, key: jax.Array | None = None) -> tuple:
        return run(params, rest, batch, jax.random.key(0) if key is None else key)

    return replicated


def _entries(spec: P, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def _axes(entries: Sequence) -> tuple[str, ...]:
    return tuple(a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e))


class Reducer:
    """Reduce per-replica gradient stacks (from :func:`per_replica`) over ``data``.

    ``params``: the abstract params (names and shapes), ``param_shardings`` their shardings.
    Call it inside the step: ``grads, extra = reducer(stacked, state.extra)``.

    ``scatter`` (optimizer state sharded over data, :mod:`jaxmp.train.zero`): each device
    keeps only its data slice of the reduced gradient — uncompressed, the all-reduce becomes
    a ``psum_scatter`` (a reduce-scatter: half the bytes; the params' all-gather after the
    update sends the other half). The encoded reductions (bfloat16, int8: already a
    reduce-scatter and an all-gather of the encoded chunks; PowerSGD: all-reduces of its
    factors) reduce whole and the step slices the result locally.
    """

    def __init__(self, comp: Compression, mesh: Mesh, params: Any, param_shardings: Any,
                 path_rules: Sequence | None = None, scatter: bool = False):
        if comp.kind not in KINDS:
            raise ValueError(f"unknown gradient compression {comp.kind!r}")
        self.comp, self.mesh = comp, mesh
        self.replicas = int(mesh.shape[DATA])
        leaves, _ = sharding.tree_leaves(params, path_rules)
        self.keys = [_key(leaf.path) for leaf in leaves]
        self.shapes = [leaf.shape for leaf in leaves]
        self.specs = [_entries(s.spec, len(leaf.shape))
                      for s, leaf in zip(jax.tree.leaves(param_shardings), leaves, strict=True)]
        self.views = [matrix_view(leaf.shape, leaf.names, comp.rank)
                      if comp.kind == "powersgd" else None for leaf in leaves]
        sizes = {str(k): int(v) for k, v in mesh.shape.items()}
        self.scatter = [data_dim(P(*e), shape, sizes) if scatter and comp.kind == "none"
                        else None for e, shape in zip(self.specs, self.shapes, strict=True)]

    def _out_spec(self, i: int) -> P:
        e, d = list(self.specs[i]), self.scatter[i]
        if d is not None:
            e[d] = (*_axes((e[d],)), DATA)
        return P(*e)

    # -- specs of the fully manual shard_map --------------------------------------------------
    def _q_spec(self, i: int) -> P:
        e, v = self.specs[i], self.views[i]
        return P(*e[:v.batch], *e[v.split:], None)

    def _state_specs(self, state: dict) -> dict:
        index = {k: i for i, k in enumerate(self.keys)}
        out: dict[str, dict] = {}
        if "residual" in state:
            out["residual"] = {k: P(DATA, *self.specs[index[k]]) for k in state["residual"]}
        if "q" in state:
            out["q"] = {k: self._q_spec(index[k]) for k in state["q"]}
        return out

    def __call__(self, stacked: Any, extra: dict) -> tuple[Any, dict]:
        flat, treedef = jax.tree.flatten(stacked)
        variables = extra.get(STATE_KEY, {}) if self.comp.stateful else {}
        arrays = jax.tree.map(lambda v: v[...], variables,
                              is_leaf=lambda x: isinstance(x, nnx.Variable))
        state_specs = self._state_specs(arrays)
        run = jax.shard_map(self._local, mesh=self.mesh,
                            in_specs=([P(DATA, *e) for e in self.specs], state_specs),
                            out_specs=([self._out_spec(i) for i in range(len(self.specs))],
                                       state_specs),
                            check_vma=False)
        reduced, new = run(flat, arrays)
        if variables:
            new = jax.tree.map(lambda v, a: v.replace(a), variables, new,
                               is_leaf=lambda x: isinstance(x, nnx.Variable))
            extra = {**extra, STATE_KEY: new}
        return jax.tree.unflatten(treedef, reduced), extra

    # -- one device's view ----------------------------------------------------------------------
    def _local(self, grads: list[jax.Array], state: dict) -> tuple[list[jax.Array], dict]:
        grads = [g[0] for g in grads]
        kind = self.comp.kind
        if kind == "none":
            return [jax.lax.psum(g, DATA) if d is None else
                    jax.lax.psum_scatter(g, DATA, scatter_dimension=d, tiled=True)
                    for g, d in zip(grads, self.scatter, strict=True)], state
        if kind == "powersgd":
            return self._powersgd(grads, state)
        return self._two_phase(grads, state)

    def _flat(self, arrays: Sequence[jax.Array]) -> jax.Array:
        return jnp.concatenate([a.astype(jnp.float32).reshape(-1) for a in arrays])

    def _unflat(self, flat: jax.Array, like: Sequence[jax.Array]) -> list[jax.Array]:
        out, start = [], 0
        for a in like:
            out.append(flat[start:start + a.size].reshape(a.shape).astype(a.dtype))
            start += a.size
        return out

    def _two_phase(self, grads: list[jax.Array], state: dict) -> tuple[list[jax.Array], dict]:
        res = state.get("residual")
        x = self._flat(grads)
        if res is not None:
            x = x + self._flat([res[k][0] for k in self.keys])
        n = x.shape[0]
        x = jnp.pad(x, (0, padded_length(n, self.replicas, self.comp.block) - n))
        total, error = two_phase_sum(x, self.comp.kind, self.comp.block, self.replicas)
        out = self._unflat(total[:n], grads)
        if res is not None:
            errs = self._unflat(error[:n], [res[k][0] for k in self.keys])
            state = {**state, "residual": {k: e[None] for k, e in zip(self.keys, errs)}}
        return out, state

    def _powersgd(self, grads: list[jax.Array], state: dict) -> tuple[list[jax.Array], dict]:
        res, qs = state.get("residual"), dict(state["q"])
        new_res = dict(res) if res is not None else None
        out: list[Any] = [None] * len(grads)
        plain = [i for i, v in enumerate(self.views) if v is None]
        if plain:  # vectors and small matrices: one float32 all-reduce of them all
            summed = jax.lax.psum(self._flat([grads[i] for i in plain]), DATA)
            for i, g in zip(plain, self._unflat(summed, [grads[i] for i in plain])):
                out[i] = g
        for i, view in enumerate(self.views):
            if view is None:
                continue
            g, k, e = grads[i], self.keys[i], self.specs[i]
            m = g.astype(jnp.float32) + (res[k][0] if res is not None else 0.0)
            b = math.prod(m.shape[:view.batch])
            rows = math.prod(m.shape[view.batch:view.split])
            q = qs[k]
            approx, mine, q_new = powersgd(m.reshape(b, rows, -1), q.reshape(b, -1, q.shape[-1]),
                                           _axes(e[view.batch:view.split]), _axes(e[view.split:]))
            out[i] = approx.reshape(g.shape).astype(g.dtype)
            qs[k] = q_new.reshape(q.shape)
            if new_res is not None:
                new_res[k] = (m - mine.reshape(m.shape))[None]
        state = {**state, "q": qs}
        if new_res is not None:
            state["residual"] = new_res
        return out, state
