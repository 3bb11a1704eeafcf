"""One layer's parameters on one (fsdp, tensor) mesh, as the rules shard them: the bytes a
device holds, gathers and reduces, and what tensor parallelism does to its matrices — the
per-layer facts :class:`jaxmp.plan.context.Context` builds its tables from."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from jaxmp import sharding
from jaxmp.compression.gather import is_matrix, wire_itemsize
from jaxmp.cost import LayerCost


@dataclass(frozen=True)
class LayerShard:
    """One layer's parameters on one mesh: bytes per device and what the axes do to them."""

    local: float  # bytes per device
    gathered: float  # bytes per device once fsdp-gathered
    unsharded_fsdp: float  # bytes fsdp does not shard (their gradients all-reduce over fsdp)
    tensor_weights: int  # matrices split by tensor
    row_parallel: int  # of those, split on their input dim (their output is all-reduced)
    tensor_dims: frozenset[int]  # sizes of dims split by tensor (to spot split activations)
    gather_wire: float = 0.0  # bytes one full gather of the fsdp-split params moves (all
    # devices' shards, in the gather's dtype): the gathered copy a layer computes with
    reduce_wire: float = 0.0  # the same for the reduce-scatter of their gradients
    cast: float = 0.0  # bytes per device of the narrow copies made before the forward pass
    grads: float = 0.0  # bytes per device of its gradients as the backward pass holds them
    row_itemsize: int = 4  # bytes per element of its row-parallel matrices (as stored)
    matrices: float = 0.0  # bytes per device of its float32 matmul weights (not lookups)
    n_matrices: int = 0  # its weight matrices, split by tensor or not
    tensor_names: frozenset[str] = frozenset()  # logical names of the dims tensor splits


def resolve_shard(lay: LayerCost, fsdp: int, tensor: int, rules: Sequence, wire: str,
                  reduce: str, compute_dtype: str | None, up: bool) -> LayerShard:
    """``lay``'s parameters on ``fsdp`` x ``tensor`` devices; ``wire`` / ``reduce``: the
    dtypes fsdp gathers weights and reduces gradients in; ``up``: the backend computes
    16-bit matmuls in float32 (XLA:CPU)."""
    sizes = {"data": 1, "stage": 1, "fsdp": fsdp, "tensor": tensor}
    # jaxmp gathers int8 (compression.gather), per layer slice inside a stack and at the
    # step's start outside one; else XLA gathers the copies the step cast on their shards,
    # and the gradients come back in the gather's dtype.
    custom = wire == "int8"
    out_item = wire_itemsize(compute_dtype or "float32", 4, up) \
        if compute_dtype in ("bfloat16", "float32") else 4
    local = gathered = unsharded = gather_wire = reduce_wire = cast = grads = matrices = 0.0
    weights = rows = n_matrices = 0
    row_item = 4
    tdims: set[int] = set()
    tnames: set[str] = set()
    # Gathered as stored ("param") with 16-bit compute, a matmul weight's cast moves before
    # its all-gather (XLA) and its gradient is reduced in the matmul's dtype (§7).
    if wire == "param" and compute_dtype == "bfloat16" \
            and lay.kind != "pre":
        wire = reduce = compute_dtype
    for leaf in lay.params:
        spec = sharding.resolve(leaf.names, leaf.shape, sizes, rules).spec \
            if leaf.names is not None else ()
        axes = [a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))]
        div = math.prod(sizes[a] for a in axes)
        nb = leaf.nbytes * lay.share
        local += nb / div
        matrices += nb / div if lay.kind != "pre" and leaf.names is not None \
            and is_matrix(leaf.names) and leaf.nbytes == 4 * math.prod(leaf.shape) else 0.0
        gathered += nb / (div // fsdp if "fsdp" in axes else div)
        unsharded += 0.0 if "fsdp" in axes else nb / div
        narrow = "fsdp" in axes and leaf.names is not None and is_matrix(leaf.names)
        if "fsdp" in axes:  # a narrower gather casts matrices only (compression.gather)
            stored = max(1, leaf.nbytes // max(1, math.prod(leaf.shape)))
            full = nb / (div // fsdp)
            g = wire_itemsize(wire if narrow else "param", stored, up) / stored
            gather_wire += full * g
            reduce_wire += full * wire_itemsize(reduce if narrow else "param", stored,
                                                up) / stored
            if narrow and custom and not lay.in_loop:
                cast += full * out_item / stored  # gathered at the step's start
            elif narrow and not custom:
                cast += nb / div * g
            grads += nb / div * (g if narrow and not custom else 1.0)
        else:
            grads += nb / div
        split = [d for d, e in enumerate(spec)
                 if e == "tensor" or (isinstance(e, tuple) and "tensor" in e)]
        tdims.update(int(leaf.shape[d]) for d in split)
        tnames.update(leaf.names[d] for d in split if leaf.names and leaf.names[d])
        # its named dims: a 2-D attention bias (heads, head_dim) named ("kv",) is no matrix
        dims = [d for d, n in enumerate(leaf.names or ()) if n is not None and n != "layers"]
        weights += bool(split) and len(dims) >= 2
        n_matrices += len(dims) >= 2
        if len(dims) >= 2 and dims[0] in split:
            rows += 1
            row_item = max(1, leaf.nbytes // max(1, math.prod(leaf.shape)))
    return LayerShard(local, gathered, unsharded, weights, rows, frozenset(tdims), gather_wire,
                  reduce_wire, cast, grads, row_item, matrices, n_matrices, frozenset(tnames))
