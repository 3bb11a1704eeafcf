"""Orbax sharded checkpoints, in pieces (the public face is :mod:`jaxmp.checkpoint`).

- :mod:`jaxmp.ckpt.tree`: any state pytree ⇄ the pure nested dict that is stored, plus the
  per-array records (logical names, saved spec, shape, dtype) that make a checkpoint describe
  itself.
- :mod:`jaxmp.ckpt.store`: the directory layout, which steps are complete, reading and writing
  one step with Orbax.
- :mod:`jaxmp.ckpt.resume`: the trainer's side: restore-or-init with fallback, periodic and final
  saves, preemption (SIGTERM / SIGINT) at a step boundary.
- :mod:`jaxmp.ckpt.tools` and :mod:`jaxmp.ckpt.cli`: ``jaxmp ckpt list|inspect|export``.

This file stays free of jax imports so the CLI can build its parser (and name the error type)
before ``--simulate-devices`` settles the backend.

On disk a run's ``checkpoints/<step>/`` holds the Orbax items

- ``state``: the arrays (Orbax PyTree, OCDBT), written shard by shard by every process;
- ``meta``: JSON, the format version, step, saved mesh and, per array path, shape, dtype,
  logical names and saved PartitionSpec;
- ``run``: JSON, the effective config as TOML text and the plan;
- ``data``: JSON, the data iterator's state (absent when the data has none).
"""


class CheckpointError(ValueError):
    """Bad checkpoint input (missing directory, unknown step, damaged files, a checkpoint that
    does not fit the model); ``str()`` is one line naming the problem."""
