"""Check a plan against the compiled program (``jaxmp plan --verify``): the Trainer built from
the very plan printed, its layout read back and compared field by field, then predicted versus
compiled per-device argument bytes, peak bytes and collective bytes.

The program compiled is the Trainer's own step, built with the Trainer's rules and path rules,
so the check covers what ``jaxmp train`` would run — the pipeline executor too, for a plan
with stages. On a machine without accelerators the devices are simulated CPU devices: the
process must have been started with enough of them (``--simulate-devices``). Collective bytes
are counted statically with each conditional charged its largest branch
(:mod:`jaxmp.hlo.branches`); a pipeline's tick conditionals on the ``M·V`` of ``T`` ticks that
run them (bubble ticks run none): what the busiest device executes, which ``jaxmp bench`` also
measures from a run.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxmp._util.io import atomic_write, make_dir

from jaxmp.errors import VerifyError
from jaxmp.plan import Plan
from jaxmp.tools.measure import Measured, measure_step, rel_err
from jaxmp.train import Trainer


def _rel(predicted: float, compiled: float) -> dict[str, float]:
    err = abs(rel_err(predicted, compiled))
    err = 1.0 if math.isinf(err) else err  # something predicted where nothing was compiled
    return {"predicted": float(predicted), "compiled": float(compiled), "rel_err": err}


def built(make_trainer: Callable[[list], Trainer], plan: Plan, devices: list,
          add: str = "add --simulate-devices") -> Trainer:
    """``make_trainer(devices)`` — the Trainer given ``plan`` — on the first ``plan.n_devices``
    of ``devices``, refused unless it built the plan's layout field by field."""
    n = plan.n_devices
    if len(devices) < n:
        raise VerifyError(f"--verify needs {n} devices but this process has {len(devices)}; "
                          f"{add} {n}")
    trainer = make_trainer(list(devices[:n]))
    differences = trainer.executed_layout().differences(plan.layout)
    if differences:
        raise VerifyError("the Trainer built another layout than the plan: "
                          + "; ".join(differences))
    return trainer


def compared(plan: Plan, m: Measured) -> dict[str, Any]:
    """The plan's predictions beside the compiled step's figures (``--verify``'s rows)."""
    predicted = plan.predicted
    return {"argument_bytes": _rel(predicted.argument_bytes, m.argument_bytes),
            "peak_bytes": _rel(predicted.per_device_bytes, m.peak_bytes),
            "comm_bytes_per_step": _rel(predicted.comm_bytes_per_step, m.collective_bytes),
            "compiled_comm_by_kind": {k: v for k, v in m.one_branch.items() if v},
            "layout": "as planned", "hlo_warnings": list(m.collectives.warnings)}


def verify_prediction(make_trainer: Callable[[list], Trainer], plan: Plan,
                      devices: list, dump_hlo: str | os.PathLike | None = None
                      ) -> dict[str, Any]:
    """Build ``make_trainer(devices)`` — the Trainer given ``plan`` — compile its step and
    compare with ``plan``'s predictions; ``dump_hlo``: a folder for the compiled module's
    text."""
    folder = hlo_folder(dump_hlo)
    m = measure_step(built(make_trainer, plan, devices))
    out = {**compared(plan, m), "backend": f"{devices[0].platform} ({plan.n_devices} devices)"}
    return {**out, **write_hlo(m, folder)}


HLO_FILE = "train_step.hlo.txt"


def hlo_folder(path: str | os.PathLike | None) -> Path | None:
    """``--dump-hlo``'s folder, created and checked before any work (None: no dump)."""
    return make_dir(Path(path), "--dump-hlo folder") if path is not None else None


def write_hlo(m: Measured, folder: Path | None) -> dict[str, str]:
    """Write the compiled module's text (``compiled.as_text()``) into ``folder`` as
    :data:`HLO_FILE`; ``{"hlo_file": path}`` (nothing without a folder)."""
    if folder is None:
        return {}
    return {"hlo_file": str(atomic_write(folder / HLO_FILE, m.compiled.as_text()))}
