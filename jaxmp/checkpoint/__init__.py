"""Sharded checkpoints that restore on any mesh, from research code or a fresh process.

A jaxmp checkpoint stores, next to the arrays, each array's logical axis names and the mesh and
PartitionSpec it was saved with. So restoring needs no model code and no trainer: only a target
mesh (default: every device, one ``fsdp`` axis) and optionally other rules::

    import jaxmp
    params = jaxmp.checkpoint.restore("runs/mine")                      # latest step, all devices
    state = jaxmp.checkpoint.restore("runs/mine", step=100, what="state",
                                     mesh=jaxmp.make_mesh({"data": 2, "tensor": 4}))

Orbax does the I/O shard by shard on every process; nothing is gathered on one device. The
pieces, none of which knows the trainer:

- :mod:`jaxmp.checkpoint.records`: any state pytree ⇄ the pure nested dict that is stored, plus
  the per-array records (logical names, saved spec, shape, dtype) that make a checkpoint
  describe itself;
- :mod:`jaxmp.checkpoint.store`: the directory layout, which steps are complete, reading and
  writing one step with Orbax;
- :mod:`jaxmp.checkpoint.api`: ``restore``, ``save``, ``info``, ``list_steps``,
  ``logical_names``;
- :mod:`jaxmp.checkpoint.inspect`: digests, ``jaxmp ckpt list|inspect`` reports and the
  safetensors export;
- :mod:`jaxmp.checkpoint.checksum`: per-array checksums written with every step and checked on
  every read, so damaged bytes are refused instead of read as numbers.

The trainer's side (resume, periodic saves) is :mod:`jaxmp.train.checkpointing`.

On disk a run's ``checkpoints/<step>/`` holds the Orbax items

- ``state``: the arrays (Orbax PyTree, OCDBT), written shard by shard by every process;
- ``meta``: JSON, the format version, step, saved mesh and, per array path, shape, dtype,
  logical names, saved PartitionSpec and checksum (validated field by field on reading:
  checkpoints are data, never code);
- ``run``: JSON, the effective config as TOML text and the plan;
- ``data``: JSON, the data iterator's state (absent when the data has none).
"""

from jaxmp.checkpoint.api import info, list_steps, logical_names, restore, save
from jaxmp.checkpoint.inspect import digest, export_safetensors, inspect_report, list_report
from jaxmp.checkpoint.store import StepInfo
from jaxmp.errors import CheckpointError, DamagedCheckpoint

__all__ = ["CheckpointError", "DamagedCheckpoint", "StepInfo", "digest", "export_safetensors",
           "info", "inspect_report", "list_report", "list_steps", "logical_names", "restore",
           "save"]
