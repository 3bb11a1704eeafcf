"""The planner's errors, importable without jax (the CLI catches them before jax starts).

``PlanError`` and its subclasses are bad input (exit 2); ``VerifyError`` is a runtime failure
of ``--verify`` (exit 1).
"""


class PlanError(ValueError):
    """The request cannot be planned (bad device count, axes that cannot fit, unknown device)."""


class PlanUsageError(PlanError):
    """Bad ``jaxmp plan`` arguments."""


class VerifyError(RuntimeError):
    """The plan cannot be compiled here (not enough devices, or pipeline stages)."""
