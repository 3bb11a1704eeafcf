"""The errors jaxmp raises for people, importable without jax (the CLI sorts them early).

Two families, one per exit code of the ``jaxmp`` command:

* :class:`BadInput` (exit 2): the user asked for something that cannot be done — a config key,
  a file, a value, a mesh. ``str()`` is one line that names the key, file or value.
* :class:`Failure` (exit 1): the request was fine but running it failed.

Each layer raises its own subclass so callers can catch narrowly, and the CLI catches the base.
"""


class JaxmpError(Exception):
    """Base of every error jaxmp raises on purpose."""


class BadInput(JaxmpError, ValueError):
    """Bad user input (exit 2); the message is one line naming the key, file or value."""


class Failure(JaxmpError, RuntimeError):
    """A runtime failure with a clear message (exit 1)."""


class ConfigError(BadInput):
    """A bad config value, key or file."""


class UsageError(BadInput):
    """Bad command-line arguments."""


class DataError(BadInput):
    """Bad data input (missing file, wrong vocab, a batch that does not split)."""


class RunDirError(BadInput):
    """A run (or output) directory that cannot be created or written."""


class CheckpointError(BadInput):
    """Bad checkpoint input (missing directory, unknown step, a checkpoint that does not fit)."""


class DamagedCheckpoint(CheckpointError):
    """A step that looked complete but cannot be read (truncated, deleted or corrupted files)."""


class UnknownDeviceError(BadInput):
    """A device kind that no profile matches (and no override supplies the numbers)."""


class PlanError(BadInput):
    """The request cannot be planned (bad device count, axes that cannot fit, unknown device)."""


class CheckpointWriteError(Failure):
    """A checkpoint could not be written (disk full, quota, I/O error); nothing partial is kept."""


class VerifyError(Failure):
    """A plan cannot be compiled here (not enough devices)."""


class MissingDependency(Failure):
    """An optional dependency is not installed; the message names the extra that brings it."""


class CudaPluginMissing(BadInput):
    """A GPU program was asked for (a deviceless compile) but JAX's CUDA plugin is missing."""
