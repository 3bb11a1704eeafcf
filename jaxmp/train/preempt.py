"""SIGTERM / SIGINT → finish the step, save, stop: preemption at a step boundary."""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax
from jax.experimental import multihost_utils

from jaxmp._util.log import say


class Preemption:
    """SIGTERM / SIGINT → finish the step, save, stop (exit 0); a second SIGINT stops at once.

    On several processes every host must stop at the same step, so SIGTERM is left to JAX's
    preemption service (``reached_preemption_sync_point``, started by
    ``jax.distributed.initialize``) which agrees on that step; handlers are only installed on
    one process.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._multi = jax.process_count() > 1

    def install(self) -> Preemption:
        """Catch the signals until :meth:`close` (main thread, single process only)."""
        if self.enabled and not self._multi and \
                threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def close(self) -> None:
        """Give the signals back to whoever handled them before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum
        say(f"jaxmp: got {signal.Signals(signum).name}; saving a checkpoint at the next step "
            f"boundary, then stopping (Ctrl-C again to stop now)")

    @property
    def reason(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "preemption"

    def requested(self, step: int) -> bool:
        """Call after every step (on every process, same steps): stop and save here?"""
        if not self.enabled:
            return False
        if self._multi:
            try:
                return bool(multihost_utils.reached_preemption_sync_point(step))
            except RuntimeError:  # preemption service disabled
                return False
        return self.signal is not None
