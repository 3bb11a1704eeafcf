"""GPU devices that are not attached: compile the real GPU program on a machine without a GPU.

With JAX's CUDA plugin installed (the ``cuda`` extra; its wheels need no GPU),
``jax.experimental.topologies.get_topology_desc(..., "cuda", target_config=..., topology=...)``
returns device descriptions of a GPU cluster. A mesh over them is an ordinary
:class:`jax.sharding.Mesh` (:func:`jaxmp.make_mesh` works on it), and
``jax.jit(f).lower(abstract args).compile()`` over that mesh runs XLA's GPU compiler here: its
``memory_analysis()`` and ``as_text()`` are those of the program the cluster would run, but
nothing can execute. JAX must run on the CPU backend meanwhile (``JAX_PLATFORMS=cpu``, set by
:func:`jaxmp._util.env.use_cpu`), or the plugin would look for a driver.

The topology string is ``"<partitions>x<hosts per partition>x<devices per host>"`` (the
plugin's format); a partition is a fast-interconnect (NVLink) domain, which for HGX A100 / H100
/ H200 hosts is one host, so N devices of 8-GPU hosts are ``"<N/8>x1x8"``. Each host's devices
share a ``process_index``, as they would in a multi-process run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
from jax.experimental import topologies

from jaxmp._util.env import cuda_plugin_installed
from jaxmp.devices import PROFILES, match_kind
from jaxmp.errors import CudaPluginMissing, Failure, PlanError, UnknownDeviceError
from jaxmp.gpu_targets import TARGETS, GpuTarget, target_config

INSTALL_HINT = 'pip install -e ".[cuda]"'


@dataclass(frozen=True)
class GpuTopology:
    """N device descriptions of one GPU kind, in hosts of ``per_host``."""

    target: GpuTarget
    hosts: int
    per_host: int
    devices: tuple[Any, ...]  # jax Device descriptions (platform "gpu"), host-major

    @property
    def spec(self) -> str:
        """The plugin's topology string."""
        return f"{self.hosts}x1x{self.per_host}"

    def __str__(self) -> str:
        return (f"{len(self.devices)} x {self.target.kind} ({self.hosts} host(s) of "
                f"{self.per_host}, deviceless)")


def gpu_target(device_kind: str) -> GpuTarget:
    """The compile target of a device kind (a profile name or a ``device_kind`` string)."""
    name = match_kind(device_kind)
    if name not in TARGETS:
        raise UnknownDeviceError(f"device kind {device_kind!r} has no GPU compile target "
                                 f"(targets: {', '.join(TARGETS)})")
    return TARGETS[name]


def require_cuda_plugin(what: str = "compiling for a GPU without one") -> None:
    """Bad input (exit 2, one line) when JAX's CUDA plugin is not installed."""
    if not cuda_plugin_installed():
        raise CudaPluginMissing(f"{what} needs JAX's CUDA plugin: {INSTALL_HINT}")


def gpu_topology(n_devices: int, device_kind: str,
                 devices_per_host: int | None = None) -> GpuTopology:
    """``n_devices`` deviceless GPUs of ``device_kind`` in hosts of ``devices_per_host``
    (default: the profile's); fewer devices than a host holds make one host.

    Raises bad input for an unknown kind, a count that is not whole hosts, or a missing CUDA
    plugin. The same request returns the same device objects (cached), so meshes built from
    them twice are equal.
    """
    target = gpu_target(device_kind)
    per_host = devices_per_host or PROFILES[target.kind].devices_per_host or n_devices
    if n_devices < 1:
        raise PlanError(f"--devices must be >= 1, got {n_devices}")
    per_host = min(per_host, n_devices)
    if n_devices % per_host:
        raise PlanError(f"{n_devices} {target.kind} devices are not whole hosts of {per_host} "
                        f"(device.devices_per_host)")
    require_cuda_plugin(f"compiling for {target.kind} without a GPU")
    return _topology(target.kind, n_devices // per_host, per_host, target_config(target))


@lru_cache(maxsize=16)
def _topology(kind: str, hosts: int, per_host: int, config_text: str) -> GpuTopology:
    spec = f"{hosts}x1x{per_host}"
    try:
        desc = topologies.get_topology_desc(f"jaxmp-{kind}-{spec}", "cuda",
                                            target_config=config_text, topology=spec)
    except Exception as e:  # noqa: BLE001 - the plugin's errors are runtime errors of any type
        raise Failure(f"JAX's CUDA plugin could not describe {hosts * per_host} x {kind} "
                      f"({spec}): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                      ) from None
    devices = tuple(sorted(desc.devices, key=lambda d: d.id))
    return GpuTopology(TARGETS[kind], hosts, per_host, devices)


def memory_limit(topology: GpuTopology, usable_fraction: float) -> float:
    """Bytes a process may use on each device: the share JAX's allocator takes
    (``XLA_PYTHON_CLIENT_MEM_FRACTION`` = ``device.usable_fraction``, set by ``jaxmp train``)
    of the memory the driver reports. A compiled program fits if its peak is within it."""
    return topology.target.memory_bytes * usable_fraction


def without_persistent_cache() -> None:
    """Turn JAX's persistent compilation cache off for this process (before its first
    compile: JAX decides once). A deviceless executable can be written to the cache but not
    read back (there is no client to load it into): every later run would warn and compile
    again, and the entries only take disk space."""
    jax.config.update("jax_enable_compilation_cache", False)
