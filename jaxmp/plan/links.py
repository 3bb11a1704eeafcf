"""How fast each mesh axis's collectives run: the links a group of devices crosses.

Within a host an axis's collectives run at NVLink's bandwidth; a group spread over hosts runs
over the hosts' NICs, as many rings in parallel as the group has members on each host.
"""

from __future__ import annotations

from collections.abc import Mapping

from jaxmp.devices import DeviceProfile
from jaxmp.mesh import AXES


def link_bw(profile: DeviceProfile, n_devices: int, sizes: Mapping[str, int]) -> dict[str, float]:
    """Bandwidth each axis's collectives run at. Across hosts, a group with ``g``
    members per host runs as ``g`` rings, each through another GPU's NIC (DGX / HGX):
    ``min(intra, g * inter)`` (nccl-tests across 8 x H100 NDR hosts: 400-450 GB/s bus
    bandwidth, saturncloud.io/blog/crusoe-nccl-cluster-validation). Stage: one NIC."""
    per_host = profile.devices_per_host or n_devices
    intra, inter, out, inner = profile.intra_host_bw, profile.inter_host_bw, {}, 1
    for axis in reversed(AXES):  # tensor innermost ... data outermost
        below, inner = inner, inner * sizes[axis]
        g = 1 if axis == "stage" or per_host % below else min(sizes[axis], per_host // below)
        out[axis] = intra if inner <= per_host else min(intra, g * inter)
    return out
