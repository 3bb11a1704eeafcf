"""Check a plan against the compiled program: predicted versus compiled per-device argument
bytes, peak bytes and collective bytes (``jaxmp plan --verify``).

The program compiled is the Trainer's own step, built with the Trainer's rules and path rules,
so the check covers what ``jaxmp train`` would run — the pipeline executor too, for a plan
with stages. On a machine without accelerators the devices are simulated CPU devices: the
process must have been started with enough of them (``jaxmp._util.env.simulate_devices``; the
CLI does that). The CPU backend compiles the pipeline's ``lax.cond`` branches as they are
(collective bytes count both branches of a tick, where only one runs), so its numbers for a
pipeline are the CPU program's, not a GPU's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from jaxmp.errors import VerifyError
from jaxmp.plan import Prediction
from jaxmp.tools.measure import measure_step, rel_err
from jaxmp.train import Trainer


def _rel(predicted: float, compiled: float) -> dict[str, float]:
    err = abs(rel_err(predicted, compiled))
    err = 1.0 if math.isinf(err) else err  # something predicted where nothing was compiled
    return {"predicted": float(predicted), "compiled": float(compiled), "rel_err": err}


def verify_prediction(make_trainer: Callable[[list], Trainer], mesh: dict[str, int],
                      predicted: Prediction, devices: list) -> dict[str, Any]:
    """Compile ``make_trainer(devices)`` on ``mesh`` and compare with ``predicted``.

    ``make_trainer`` builds the Trainer that would run the plan (its config's mesh set to
    ``mesh``) on the devices it is given.
    """
    n = math.prod(mesh.values())
    if len(devices) < n:
        raise VerifyError(f"--verify needs {n} devices but this process has {len(devices)}; "
                          f"start it with {n} simulated devices")
    m = measure_step(make_trainer(list(devices[:n])))
    stats = m.collectives
    return {"argument_bytes": _rel(predicted.argument_bytes, m.argument_bytes),
            "peak_bytes": _rel(predicted.per_device_bytes, m.peak_bytes),
            "comm_bytes_per_step": _rel(predicted.comm_bytes_per_step, stats.total_bytes),
            "compiled_comm_by_kind": {k: v for k, v in stats.bytes_by_kind.items() if v},
            "hlo_warnings": list(stats.warnings)}
