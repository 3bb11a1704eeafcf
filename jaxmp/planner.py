"""Choosing the mesh. (Interim: the cost-model planner of issue B replaces the heuristic.)"""

from __future__ import annotations

from jaxmp.config import Config


def choose_mesh(config: Config, n_devices: int) -> dict[str, int]:
    """Pick axis sizes for ``n_devices`` when the config leaves the mesh on ``auto``.

    Data parallelism is the cheapest in communication (one gradient all-reduce per step) as
    long as a full replica of params + Adam state (16 bytes/param in float32) fits; beyond
    that, shard everything with fsdp.
    """
    from jaxmp.recipes import gpt_config

    n_params = gpt_config(config).n_params
    replica_bytes = 16 * n_params
    if replica_bytes < 2 * 1024**3 or n_devices == 1:
        return {"data": n_devices}
    return {"fsdp": n_devices}
