"""What a run reports: metrics.jsonl, TensorBoard events, a progress line, MFU, profiler traces.

Only process 0 writes (``enabled=False`` elsewhere) so several hosts never race on one file.
Each metrics.jsonl line is flushed as it is written: a killed run keeps every logged step. A
resumed run first drops the lines past the step it resumes from (they are logged again) and a
line cut short by a kill, so the file reads like one uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
from tensorboardX import SummaryWriter

from jaxmp._util.io import atomic_write
from jaxmp.devices import profile_for
from jaxmp.errors import Failure


def total_peak_flops(devices: Sequence[Any]) -> float:
    """Peak FLOP/s of all ``devices`` together, the denominator of MFU.

    On CPU the simulated devices share the host's cores, so the host's measured matmul rate
    is the peak of all of them together (per host), not per device.
    """
    if not devices:
        return float("nan")
    prof = profile_for(devices[0].device_kind if devices[0].platform != "cpu" else "CPU")
    if devices[0].platform == "cpu":
        return prof.peak_flops * len({d.process_index for d in devices})
    return prof.peak_flops * len(devices)


class MetricsWriter:
    """Appends one JSON object per logged step and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True, tensorboard: bool = True,
                 resume_step: int | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            self._truncate(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), flush_secs=10)

    def _truncate(self, step: int) -> None:
        """Keep only whole lines of steps <= ``step`` (rewritten atomically if any go)."""
        if not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        kept = []
        for line in lines:
            try:
                whole = line.endswith("\n") and int(json.loads(line)["step"]) <= step
            except (ValueError, KeyError, TypeError):
                whole = False
            if whole:
                kept.append(line)
        if len(kept) != len(lines):
            atomic_write(self.path, "".join(kept))

    def write(self, step: int, scalars: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step)}
        for k, v in scalars.items():
            v = float(v) if not isinstance(v, (str, bool)) else v
            record[k] = v if not (isinstance(v, float) and math.isnan(v)) else None
        end = self._file.tell()
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:  # e.g. the disk is full: never leave half a line behind
            self._file = None
            with open(self.path, "r+b") as f:
                f.truncate(end)
            raise Failure(f"cannot write {self.path}: {e.strerror or e}") from None
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, global_step=int(step))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class Progress:
    """A one-line progress display: redrawn in place on a terminal, plain lines otherwise."""

    def __init__(self, total_steps: int, enabled: bool = True, stream=None):
        self.total = total_steps
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float, extra: str = "") -> None:
        if not self.enabled:
            return
        width = len(str(self.total))
        elapsed = time.perf_counter() - self.start
        line = (f"step {step:>{width}}/{self.total}  loss {loss:7.4f}  "
                f"{tokens_per_s:10,.0f} tok/s  {elapsed:6.1f}s{extra}")
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        self.stream.write(("\n" if self.tty else "") + text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


class Profiler:
    """A jax.profiler trace over the step range [start, stop), written under the run dir."""

    def __init__(self, steps: Sequence[int], run_dir: Path, enabled: bool):
        self.range = tuple(steps) if steps else None
        self.dir = run_dir / "profile"
        self.enabled = enabled and self.range is not None
        self.active = False

    def maybe_start(self, step: int) -> None:
        if self.enabled and not self.active and step == self.range[0]:
            jax.profiler.start_trace(str(self.dir))
            self.active = True

    def maybe_stop(self, done: int) -> None:
        if self.active and done >= self.range[1]:
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
