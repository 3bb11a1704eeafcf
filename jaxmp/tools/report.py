"""``jaxmp report``: a run directory (or several, overlaid) as pictures and a short report.md.

Reads what every run writes (``metrics.jsonl``, ``config.toml``, ``plan.json``) and draws loss
and eval loss, tokens/s, MFU and gradient norm over steps, one colour per run. Needs only the
files, so it works on a run that is still going or was killed (a torn last line is skipped).
"""

from __future__ import annotations

import json
import os
import statistics
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxmp._util.fmt import fmt_bytes, fmt_time, md_table, mesh_str
from jaxmp._util.io import atomic_write
from jaxmp.errors import UsageError
from jaxmp.tools import charts

PLOTS = ("loss.png", "tokens_per_s.png", "mfu.png", "grad_norm.png")


@dataclass
class Run:
    name: str
    path: Path
    metrics: list[dict[str, Any]]
    config: dict[str, Any]
    plan: dict[str, Any]

    def series(self, key: str) -> tuple[list[float], list[float | None]]:
        rows = [m for m in self.metrics if key in m]
        return [m["step"] for m in rows], [m[key] for m in rows]

    def last(self, key: str) -> float | None:
        values = [m[key] for m in self.metrics if m.get(key) is not None]
        return values[-1] if values else None

    def median(self, key: str) -> float | None:
        values = [m[key] for m in self.metrics if m.get(key) is not None]
        return statistics.median(values) if values else None


def _read_json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a killed run
        if isinstance(record, dict) and "step" in record:
            out.append(record)
    return out


def read_run(path: str | os.PathLike) -> Run:
    """A run directory's metrics, effective config and plan (the last two may be missing)."""
    path = Path(path)
    metrics_file = path / "metrics.jsonl"
    if not metrics_file.is_file():
        raise UsageError(f"{path}: no metrics.jsonl here (not a jaxmp run directory?)")
    metrics = _read_json_lines(metrics_file)
    if not metrics:
        raise UsageError(f"{metrics_file}: no logged steps yet")
    config, plan = {}, {}
    if (path / "config.toml").is_file():
        config = tomllib.loads((path / "config.toml").read_text(encoding="utf-8"))
    if (path / "plan.json").is_file():
        plan = json.loads((path / "plan.json").read_text(encoding="utf-8"))
    return Run(path.resolve().name, path, metrics, config, plan)


def _names(runs: list[Run]) -> None:
    """Give runs with the same directory name their path instead, so legends stay apart."""
    seen = [r.name for r in runs]
    for r in runs:
        if seen.count(r.name) > 1:
            r.name = str(r.path)


def write_plots(runs: list[Run], out: Path) -> list[Path]:
    """loss.png (train solid, eval dashed), tokens_per_s.png, mfu.png, grad_norm.png."""
    loss = []
    for r in runs:
        loss.append((f"{r.name} (train)", *r.series("loss"), "-"))
        if any(m.get("eval_loss") is not None for m in r.metrics):
            loss.append((f"{r.name} (eval)", *r.series("eval_loss"), "--"))
    paths = [charts.lines(out / PLOTS[0], "Loss", "loss (nats per token)", loss)]
    paths.append(charts.lines(out / PLOTS[1], "Throughput", "tokens/s",
                              [(r.name, *r.series("tokens_per_s"), "-") for r in runs],
                              fmt_y=lambda v: f"{v:,.0f}"))
    paths.append(charts.lines(out / PLOTS[2], "Model FLOPs utilisation", "MFU",
                              [(r.name, *r.series("mfu"), "-") for r in runs],
                              fmt_y=lambda v: f"{v:.0%}"))
    paths.append(charts.lines(out / PLOTS[3], "Gradient norm (before clipping)", "global norm",
                              [(r.name, *r.series("grad_norm"), "-") for r in runs], log_y=True))
    return paths


def _model_line(r: Run) -> str:
    m, t, d = (r.config.get(k, {}) for k in ("model", "train", "data"))
    parts = []
    if m:
        parts.append(f"{m.get('layers')} layers × d_model {m.get('d_model')}, {m.get('heads')} "
                     f"heads, vocab {m.get('vocab_size')}, {m.get('compute_dtype')}, "
                     f"remat {m.get('remat')}")
    if t:
        batch = f"batch {t.get('batch_size')}" + (f" × {d['seq_len']}" if "seq_len" in d else "")
        parts.append(f"{batch}, {t.get('steps')} steps, microbatches "
                     f"{t.get('microbatches', t.get('grad_accum', 1))}")
    if d.get("source"):
        parts.append(f"data {d['source']}")
    return "; ".join(parts) or "(no config.toml)"


def _plan_line(r: Run) -> str:
    p = r.plan
    if not p:
        return "(no plan.json)"
    line = f"mesh {mesh_str(p.get('mesh', {}))} on {p.get('devices', '?')} device(s)"
    if p.get("param_bytes"):
        line += f", {fmt_bytes(p['param_bytes'])} of parameters"
    lay = p.get("layout") or {}
    if lay:
        line += (f"; remat {lay.get('remat')}, {lay.get('microbatches')} microbatch(es)"
                 + (f", {lay['schedule']} x{lay.get('virtual_stages', 1)}"
                    if lay.get("schedule") else ""))
    pred = p.get("predicted")
    if pred:
        measured = r.median("step_time_s")
        line += (f"; the planner predicted {fmt_time(pred['step_time_s'])} per step and "
                 f"{fmt_bytes(pred['per_device_bytes'])} per device")
        if measured:
            line += f" (measured median step {fmt_time(measured)})"
    return line


def _num(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def render(runs: list[Run], pictures: list[Path]) -> str:
    out = ["# jaxmp report", ""]
    rows = [[r.name, str(r.metrics[-1]["step"]), _num(r.last("loss"), ".4f"),
             _num(r.last("eval_loss"), ".4f"), _num(r.median("tokens_per_s"), ",.0f"),
             _num(r.median("mfu"), ".2%"), fmt_time(r.median("step_time_s") or float("nan")),
             _num(r.last("grad_norm"), ".3f")] for r in runs]
    out += md_table(["run", "last step", "loss", "eval loss", "tokens/s (median)",
                     "MFU (median)", "step time (median)", "grad norm"], rows,
                    right=set(range(1, 8)))
    for r in runs:
        out += ["", f"## {r.name}", "", f"- directory: `{r.path}`", f"- config: {_model_line(r)}",
                f"- plan: {_plan_line(r)}"]
    if pictures:
        out += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pictures]
    return "\n".join(out) + "\n"


def write_report(run_dirs: list[str | os.PathLike], out: str | os.PathLike | None = None
                 ) -> list[Path]:
    """Plots and report.md for ``run_dirs`` under ``out`` (default: the first run's
    ``report/``); returns the files written."""
    runs = [read_run(p) for p in run_dirs]
    if not runs:
        raise UsageError("jaxmp report needs at least one RUN_DIR")
    _names(runs)
    out = Path(out) if out is not None else runs[0].path / "report"
    charts.figure("jaxmp report")  # a missing matplotlib fails before anything is written
    out.mkdir(parents=True, exist_ok=True)
    pictures = write_plots(runs, out)
    return pictures + [atomic_write(out / "report.md", render(runs, pictures))]
