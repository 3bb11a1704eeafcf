"""Device meshes with jaxmp's four named axes.

Every mesh has the axes ``data``, ``stage``, ``fsdp`` and ``tensor`` (size 1 when unused), in
that order, so rules and plans can always name them. The order puts ``tensor`` innermost
(neighbouring devices, fastest links) and ``data`` outermost (slowest links are fine for one
gradient all-reduce per step).

Axis types are ``Auto`` on purpose: the train step is one ``jax.jit`` with in/out shardings and
activation constraints by logical name, and GSPMD propagates the rest. ``Explicit`` axes would
make every op in model code declare its output sharding, i.e. put mesh knowledge into the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxmp.config.sections import MESH_AXES as AXES
# Which axes may span hosts, most preferred first: data parallelism needs one all-reduce per
# step, pipeline stages only point-to-point sends; fsdp gathers every layer; tensor never.
_CROSS_HOST_ORDER: tuple[str, ...] = ("data", "stage", "fsdp")


def resolve_axes(axes: Mapping[str, int], n_devices: int) -> dict[str, int]:
    """Return all four axis sizes, filling one ``-1`` so the product equals ``n_devices``."""
    unknown = sorted(set(axes) - set(AXES))
    if unknown:
        raise ValueError(f"unknown mesh axis {unknown[0]!r}; axes are {', '.join(AXES)}")
    sizes = {name: int(axes.get(name, 1)) for name in AXES}
    fill = [n for n, s in sizes.items() if s == -1]
    bad = [f"{n}={s}" for n, s in sizes.items() if s < 1 and s != -1]
    if bad:
        raise ValueError(f"mesh axis sizes must be >= 1 (or one -1): {', '.join(bad)}")
    if len(fill) > 1:
        raise ValueError(f"only one mesh axis may be -1, got {', '.join(fill)}")
    known = math.prod(s for s in sizes.values() if s != -1)
    shown = " x ".join(f"{n}={s}" for n, s in sizes.items() if s != 1)
    if fill:
        if n_devices % known:
            raise ValueError(
                f"mesh {shown} cannot fill {n_devices} devices: {n_devices} is not divisible by {known}")
        sizes[fill[0]] = n_devices // known
    elif known != n_devices:
        raise ValueError(
            f"mesh {shown or 'of size 1'} needs {known} devices but {n_devices} are available")
    return sizes


def _cross_host_split(sizes: dict[str, int], n_hosts: int) -> list[int]:
    """Split ``n_hosts`` over the axes allowed to span hosts; returns the DCN shape per axis."""
    dcn = {n: 1 for n in AXES}
    left = n_hosts
    for name in _CROSS_HOST_ORDER:
        g = math.gcd(left, sizes[name])
        dcn[name], left = g, left // g
    if left != 1:
        raise ValueError(
            f"cannot lay mesh {sizes} over {n_hosts} hosts: data x stage x fsdp must be a multiple "
            f"of the host count (tensor stays inside a host)")
    return [dcn[n] for n in AXES]


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build a mesh over ``devices`` (default: all) with axes data, stage, fsdp, tensor.

    ``axes`` maps axis names to sizes; missing axes are 1 and one axis may be ``-1`` (fill).
    On several processes the layout keeps ``tensor`` (then ``fsdp``) inside a host.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = resolve_axes(axes, len(devices))
    shape = [sizes[n] for n in AXES]
    n_hosts = len({d.process_index for d in devices})
    if n_hosts > 1:
        dcn = _cross_host_split(sizes, n_hosts)
        ici = [s // d for s, d in zip(shape, dcn)]
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    else:
        try:
            grid = mesh_utils.create_device_mesh(shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """The mesh's axis sizes as a plain dict (for plans, checkpoints and logs)."""
    return {str(k): int(v) for k, v in mesh.shape.items()}


def current_mesh(mesh: Mesh) -> Any:
    """``mesh`` as seen by code traced now: inside ``jax.shard_map``, the context's abstract
    mesh, which knows the manual axes (the pipeline's ``stage``, a data replica's ``data``) —
    constraints or a nested shard_map on the concrete mesh would clash with it there."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes and context.axis_names == mesh.axis_names:
        return context
    return mesh


def manual_axes(mesh: Any) -> frozenset[str]:
    """The axes an enclosing ``shard_map`` has made manual where code is traced now (none
    outside one)."""
    return frozenset(current_mesh(mesh).manual_axes)


def shard_map_over(fn: Callable[..., Any], mesh: Mesh, axes: Collection[str], in_specs: Any,
                   out_specs: Any, check_vma: bool = False) -> Callable[..., Any]:
    """``fn`` on local arrays, manual over ``axes`` only (the rest stay automatic: XLA
    partitions them), on the mesh traced now (nested in an enclosing ``shard_map``). The
    ring's and the stages' bodies mix values that vary over the manual axes with ones that do
    not, so jax's varying-axes check is off."""
    return jax.shard_map(fn, mesh=current_mesh(mesh), in_specs=in_specs, out_specs=out_specs,
                         axis_names=set(axes), check_vma=check_vma)
