"""Check a plan against the GPU compiler without a GPU (``jaxmp plan --verify --aot``).

The Trainer is built from the very plan printed, on deviceless GPU devices of the target kind
(:func:`jaxmp.topology.gpu_topology`: N devices in hosts of the profile's
``devices_per_host``), and its own step — the one ``jaxmp train`` runs: the same step builder,
shardings, pipeline executor, remat, dtypes and GPU compile flags — is lowered from abstract
state (nothing is allocated: a 70B model compiles on a laptop) and compiled by XLA's GPU
compiler here. What comes back is what the cluster would run, except its timing:

* the ``--verify`` rows: predicted versus compiled argument, peak and collective bytes per
  device (:mod:`jaxmp.tools.verify`);
* whether the compiled program fits: its peak (``memory_analysis()``: the buffer assignment's
  arguments + temporaries, which is what the GPU runtime allocates for the executable) within
  the memory the planner may fill (the profile's ``usable_fraction`` of the device's memory,
  which ``jaxmp train`` gives JAX's allocator). XLA's rematerialization pass may warn "Can't
  reduce memory use below ..." with a larger estimate: it is reported beside the verdict
  (``xla_rematerialization``), as information, not as the verdict — the pass's live-byte
  count adds up every branch of a conditional and a loop's state at the call site and in its
  body, and models no buffer reuse by elementwise ops; the runtime allocates the buffer
  assignment instead (docs/planner.md §7, ``tests/test_deviceless.py``);
* per collective kind, its bytes and how many async collectives have a matmul scheduled
  between start and done (:func:`jaxmp.hlo.collective_overlap`), and the fsdp all-gathers of
  the layer loop that do not.

JAX must run on the CPU backend (``JAX_PLATFORMS=cpu``, :func:`jaxmp._util.env.use_cpu`):
the CLI sets it before JAX starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from jaxmp.hlo import collective_overlap
from jaxmp.plan import Plan
from jaxmp.tools.measure import measure_step
from jaxmp.tools.verify import built, compared, hlo_folder, write_hlo
from jaxmp.topology import GpuTopology, without_persistent_cache
from jaxmp.train import Trainer

_REMAT = re.compile(r"Can't reduce memory use below .*?\((\d+) bytes\).*?only reduced to "
                    r".*?\((\d+) bytes\)")


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Collect what is written to file descriptor 2 meanwhile (XLA's C++ log lines go there,
    not through Python) into the yielded list, one line per entry. If the block raises, the
    text is written back to stderr so nothing said about the failure is lost."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    ok = False
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            lines.extend(text.splitlines())
            if not ok and text:
                os.write(2, text.encode())


def remat_shortfall(lines: list[str]) -> dict[str, float] | None:
    """XLA's rematerialization warning in ``lines``: ``{"limit_bytes", "needed_bytes"}`` (the
    compiler's own limit and what the program still needed), or None."""
    for line in lines:
        found = _REMAT.search(line)
        if found:
            return {"limit_bytes": float(found[1]), "needed_bytes": float(found[2])}
    return None


def aot_verify(make_trainer: Callable[[list], Trainer], plan: Plan, topology: GpuTopology,
               dump_hlo: str | os.PathLike | None = None) -> dict[str, Any]:
    """Build ``make_trainer(devices)`` — the Trainer given ``plan`` — on ``topology``'s
    deviceless GPUs, compile its step with the GPU compiler and compare with ``plan``'s
    predictions (see the module docstring). ``dump_hlo``: a folder for the compiled module's
    text."""
    folder = hlo_folder(dump_hlo)
    without_persistent_cache()  # a deviceless executable cannot be read back from it
    trainer = built(make_trainer, plan, list(topology.devices), add="use --devices")
    start = time.perf_counter()
    with captured_stderr() as said:
        m = measure_step(trainer)
    seconds = time.perf_counter() - start
    short = remat_shortfall(said)
    others = [line for line in said if not _REMAT.search(line)]
    if others:  # not ours to swallow
        print("\n".join(others), file=sys.stderr)
    out = compared(plan, m)
    limit = float(plan.memory_limit or topology.target.memory_bytes)
    fits = m.peak_bytes <= limit  # what the runtime allocates; the remat estimate is not
    overlap = collective_overlap(m.compiled, len(topology.devices))
    out.update({
        "backend": f"XLA's GPU compiler, {topology}", "compile_s": seconds,
        "memory_limit_bytes": limit, "fits": fits, "predicted_fits": plan.fits,
        "fits_agree": plan.fits == fits, "xla_rematerialization": short,
        "xla_warnings": [line for line in said if _REMAT.search(line)],
        "collectives": overlap.to_json(), "xla_flags": trainer.compile_options()})
    return {**out, **write_hlo(m, folder)}
