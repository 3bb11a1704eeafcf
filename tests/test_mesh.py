"""make_mesh: four named axes, -1 fills, clear errors, Auto axis types, host-aware layout."""
from __future__ import annotations

import pytest
from jax.sharding import AxisType

import jaxmp
from jaxmp.mesh import AXES, _cross_host_split, resolve_axes


def test_axes_sizes_and_types():
    mesh = jaxmp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert mesh.axis_names == AXES
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "tensor": 2}
    assert set(mesh.axis_types) == {AxisType.Auto}
    assert dict(jaxmp.make_mesh({"fsdp": -1}).shape)["fsdp"] == 8
    assert dict(jaxmp.make_mesh({"data": 2, "tensor": -1}).shape)["tensor"] == 4
    assert jaxmp.make_mesh({}, devices=jaxmp.make_mesh({"data": 8}).devices.flat[:1]).size == 1


@pytest.mark.parametrize("axes,needle", [
    ({"data": 3}, "needs 3 devices but 8"),
    ({"data": 2, "fsdp": 2}, "needs 4 devices but 8"),
    ({"data": 3, "fsdp": -1}, "not divisible by 3"),
    ({"data": -1, "fsdp": -1}, "only one mesh axis may be -1"),
    ({"pipeline": 2}, "unknown mesh axis 'pipeline'"),
    ({"data": 0}, "data=0"),
])
def test_bad_meshes_name_the_problem(axes, needle):
    with pytest.raises(ValueError, match=needle):
        jaxmp.make_mesh(axes)


def test_hosts_split_over_data_first_and_never_tensor():
    sizes = resolve_axes({"data": 2, "fsdp": 2, "tensor": 4}, 16)
    assert _cross_host_split(sizes, 2) == [2, 1, 1, 1]
    assert _cross_host_split(resolve_axes({"fsdp": 4, "tensor": 4}, 16), 4) == [1, 1, 4, 1]
    with pytest.raises(ValueError, match="tensor stays inside a host"):
        _cross_host_split(resolve_axes({"tensor": 8}, 8), 2)
