"""What a run reports: metrics.jsonl, TensorBoard events, a progress bar, MFU, profiler traces.

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
from rich.console import Console
from rich.progress import BarColumn, TextColumn
from rich.progress import Progress as RichProgress
from tensorboardX import FileWriter
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.summary import scalar as tb_scalar

from jaxmp._util.io import atomic_write
from jaxmp.devices import profile_for
from jaxmp.errors import Failure


def batch_tokens(batch: Any) -> int:
    """Tokens in a batch: the size of ``inputs`` if it has one, else its leading dimension."""
    if "inputs" in batch:
        return int(math.prod(batch["inputs"].shape))
    return int(jax.tree.leaves(batch)[0].shape[0])


def memory_metrics(devices: Sequence[Any]) -> dict[str, float]:
    """``{"peak_bytes": ...}``: the most bytes any of ``devices`` has held so far, as the
    runtime counts them (GPU, TPU); empty where the backend does not say (CPU)."""
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 - a backend without memory statistics
            stats = {}
        if "peak_bytes_in_use" in stats:
            peaks.append(float(stats["peak_bytes_in_use"]))
    return {"peak_bytes": max(peaks)} if peaks else {}


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
            self._tb = FileWriter(str(Path(run_dir) / "tensorboard"), flush_secs=10)

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
        if self._tb is not None:  # one event for all scalars: one trip through its queue
            values = [v for k, x in record.items()
                      if k != "step" and isinstance(x, (int, float)) and not isinstance(x, bool)
                      for v in tb_scalar(k, x).value]
            self._tb.add_summary(Summary(value=values), global_step=int(step))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class Progress:
    """Training progress: step/total, loss, tokens/s, elapsed and ETA.

    On a terminal a rich progress bar is redrawn in place (refreshed only when a step is
    logged: no background thread competes with the loop); elsewhere (CI, a log file) each
    update is one plain line. Messages go above the bar.
    """

    def __init__(self, total_steps: int, enabled: bool = True, stream=None):
        self.total = total_steps
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._first: tuple[int, float] | None = None  # (step, time) of the first update
        self._bar = self._task = None
        if enabled and self.tty:
            self._bar = RichProgress(
                TextColumn("step {task.completed:>%d.0f}/{task.total:.0f}" % len(str(total_steps))),
                BarColumn(), TextColumn("{task.fields[text]}"),
                console=Console(file=self.stream, force_terminal=True, highlight=False),
                auto_refresh=False)  # stdout/stderr writes are shown above the bar

    def _eta(self, step: int, now: float) -> float | None:
        """Seconds left at the rate since the first update (compile and warm-up excluded)."""
        if self._first is None or step <= self._first[0]:
            return None
        s0, t0 = self._first
        return (now - t0) / (step - s0) * (self.total - step)

    def update(self, step: int, loss: float, tokens_per_s: float, extra: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        eta = self._eta(step, now)
        if self._first is None:
            self._first = (step, now)
        text = (f"loss {loss:7.4f}  {tokens_per_s:10,.0f} tok/s  elapsed {_clock(now - self.start)}"
                f"  ETA {_clock(eta) if eta is not None else '--:--'}{extra}")
        if self._bar is None:
            width = len(str(self.total))
            self.stream.write(f"step {step:>{width}}/{self.total}  {text}\n")
            self.stream.flush()
            return
        if self._task is None:
            self._task = self._bar.add_task("train", total=self.total, completed=step, text=text)
            self._bar.start()  # draws it
            return
        self._bar.update(self._task, completed=step, text=text)
        self._bar.refresh()

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None and self._task is not None:
            self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
            self._bar.refresh()
            return
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.stop()
            self._task = None


def _clock(seconds: float) -> str:
    """``75`` → ``"1:15"``, ``3725`` → ``"1:02:05"``."""
    s = int(round(max(seconds, 0.0)))
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


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
