"""Multi-process runs: join with a short heartbeat, and leave at once when a process is lost.

When one process of a run dies (SIGKILL, OOM kill, a crashed host) the others must not hang.
What JAX does, and what jaxmp changes (measured with 2 local processes, jax 0.10;
docs/reliability.md):

- **The coordinator (process 0) dies**: JAX's client in every other process notices at once and
  ends the process itself ("Terminating process because the JAX distributed service detected
  fatal errors ... another task died", exit 134). Nothing to add.
- **Another process dies**: the survivors' next collective fails in Python (gloo: "Connection
  reset by peer"), or — if no collective is running, or the host vanished without closing its
  sockets — JAX's coordination service declares the process dead after the heartbeat timeout
  and ends the others as above. jaxmp shortens that timeout from JAX's 100 s to
  :data:`HEARTBEAT_TIMEOUT_S`, and a process whose step failed leaves with ``os._exit``
  (:func:`leave`) after one line naming the cause (:func:`failure_line`): a normal exit would
  wait in JAX's shutdown barrier (an atexit hook) for the dead process until that timeout.

Either way the checkpoints stay consistent (a step counts only once committed), and starting
all processes again with the same run directory resumes from the last complete step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

import jax
from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils

from jaxmp.checkpoint import store

HEARTBEAT_TIMEOUT_S = 30  # JAX's default is 100 s; a lost process must be noticed within 60 s
# What a collective or coordination call says when the process at the other end is gone.
_LOST = ("gloo", "connection reset", "connection closed", "connection refused",
         "socket closed", "broken pipe", "heartbeat", "unavailable", "coordination service")
_joined: dict[str, object] = {}
_barriers: dict[str, int] = {}


def join(coordinator: str | None = None, num_processes: int | None = None,
         process_id: int | None = None, *, heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
         join_timeout_s: int = 300, run_dir: str | os.PathLike | None = None) -> None:
    """``jax.distributed.initialize`` (explicit, or auto-detected when all are None) with a
    short heartbeat; gloo collectives on CPU. ``join_timeout_s``: how long to wait for every
    process at start-up (a process lost before it joined is noticed only then). ``run_dir``
    names the last checkpoint in messages."""
    if heartbeat_timeout_s < 1:
        raise ValueError(f"the heartbeat timeout must be >= 1 s, got {heartbeat_timeout_s}")
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               initialization_timeout=join_timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)
    _joined.update(run_dir=run_dir, processes=jax.process_count())


def align(name: str, timeout_s: int = 1800) -> None:
    """Wait until every process gets here, through JAX's coordination service.

    Call it before the first run of newly compiled cross-process programs: gloo gives the
    processes 30 s to meet in a new program, so one that compiles slowly (a loaded host)
    would make the others fail. A service barrier waits up to ``timeout_s`` and still fails
    at once when a process is lost. No-op on one process.
    """
    if jax.process_count() == 1:
        return
    client = getattr(jax_distributed.global_state, "client", None)  # no public API in jax 0.10
    _barriers[name] = _barriers.get(name, 0) + 1
    if client is None or not hasattr(client, "wait_at_barrier"):
        multihost_utils.sync_global_devices(f"jaxmp:{name}")
        return
    client.wait_at_barrier(f"jaxmp:{name}:{_barriers[name]}", timeout_in_ms=timeout_s * 1000)


def joined() -> bool:
    """True once this process joined a multi-process run through :func:`join`."""
    return bool(_joined)


def _last_checkpoint() -> str:
    run_dir = _joined.get("run_dir")
    try:
        steps = store.complete_steps(Path(run_dir) / "checkpoints") if run_dir else []
    except OSError:
        steps = []
    return f"checkpoint step {steps[-1]}" if steps else "its last complete checkpoint (none yet)"


def failure_line(error: BaseException) -> str | None:
    """One line for a failure caused by a lost process (and what to do), or None if the
    error does not look like one."""
    text = " ".join(str(error).split())
    if not joined() or not any(word in text.lower() for word in _LOST):
        return None
    n = _joined["processes"]
    cause = text if len(text) <= 200 else text[:197] + "..."
    return (f"lost contact with another process of this {n}-process run ({cause}); start all "
            f"{n} processes again with the same --run-dir to resume from {_last_checkpoint()}")


def leave(code: int) -> NoReturn:
    """Exit now: flush, then ``os._exit`` — skipping JAX's shutdown barrier, which would wait
    for every process, dead ones included."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
