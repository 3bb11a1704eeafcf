"""Non-finite guard: a step whose loss or gradient is NaN/inf changes nothing but counters.

Inside the jitted step (:meth:`NonFiniteGuard.apply`): when the loss or the global gradient
norm is not finite, every array of the new state — params, optimizer state, model state, other
extensions — is replaced by the old one with one ``jnp.where`` per array (fused into the
update by XLA: no extra copy of the state lives). Only the step counter advances (so the data
stream moves past the bad batch) and the guard's counters in ``state.extra["guard"]`` count
the skip. With everything finite the ``where`` picks the new arrays bit for bit.

After ``train.max_skipped`` consecutive skips the guard *latches*: every later step is skipped
too, so the state stays the last finite one until the host looks — at a logged step, before a
checkpoint is written, at the end — and stops the run (:class:`NonFiniteError`, exit 1). The
host never waits on the device every step for this, and a latched state is never saved (nor,
checked at every save by :mod:`jaxmp.train.checkpointing`, any state holding NaN/inf).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxmp.errors import Failure

KEY = "guard"  # the guard's entry in TrainState.extra


class NonFiniteError(Failure):
    """Too many consecutive non-finite steps: the run stopped with its last finite state."""


def _counters(params: Any) -> dict[str, jax.Array]:
    """The guard's state: total skips, the current streak and the step it started at."""
    del params  # a scalar extension: nothing is shaped like the params
    zero = jnp.zeros((), jnp.int32)
    return {"skipped": zero, "streak": zero, "streak_start": zero}


class NonFiniteGuard:
    """Skip non-finite updates inside the step; stop after ``max_skipped`` in a row."""

    extension = staticmethod(_counters)  # register under KEY in the Trainer's extensions

    def __init__(self, max_skipped: int):
        if max_skipped < 1:
            raise ValueError(f"max_skipped must be >= 1, got {max_skipped}")
        self.max_skipped = max_skipped

    def apply(self, old: Any, new: Any, loss: jax.Array,
              grad_norm: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
        """Inside jit: ``new`` if the step is finite (and not latched), else ``old`` with the
        step counter and the guard's counters advanced. Returns (state, metrics)."""
        g = old.extra[KEY]
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        ok = finite & (g["streak"] < self.max_skipped)
        frozen = new.replace(step=old.step, extra={**new.extra, KEY: g})
        chosen = jax.tree.map(lambda n, o: jnp.where(ok, n, o), frozen, old)
        counters = {"skipped": g["skipped"] + (~ok).astype(jnp.int32),
                    "streak": jnp.where(ok, 0, g["streak"] + 1),
                    "streak_start": jnp.where(ok | (g["streak"] > 0), g["streak_start"],
                                              old.step)}
        state = chosen.replace(step=new.step, extra={**chosen.extra, KEY: counters})
        return state, {"skipped_steps": counters["skipped"], "skip_streak": counters["streak"]}

    def check(self, state: Any) -> None:
        """On the host (blocks on the step): raise once the guard has latched."""
        g = getattr(state, "extra", {}).get(KEY)
        if g is None:
            return
        streak = int(g["streak"])
        if streak < self.max_skipped:
            return
        first = int(g["streak_start"]) + 1  # steps are counted from 1, as in metrics.jsonl
        raise NonFiniteError(
            f"{self.max_skipped} consecutive steps ({first}..{first + self.max_skipped - 1}) "
            f"had a non-finite loss or gradient (train.max_skipped={self.max_skipped}); their "
            f"updates were skipped and the run stopped with the state of step {first - 1} "
            f"(nothing non-finite was saved); lower optimizer.lr or check the data of those "
            f"steps")

    @staticmethod
    def record(metrics: dict[str, Any]) -> dict[str, float]:
        """The guard's fields of a metrics.jsonl record (none if the step ran without it)."""
        return {"skipped_steps": float(metrics["skipped_steps"])} \
            if "skipped_steps" in metrics else {}
