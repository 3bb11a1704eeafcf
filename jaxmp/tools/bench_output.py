"""What ``jaxmp bench`` shows and writes: the tables (bench.md), bench.json, PNG bar charts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jaxmp._util.fmt import fmt_bytes, fmt_flops, fmt_time, md_table, mesh_str
from jaxmp._util.io import atomic_write
from jaxmp.errors import MissingDependency
from jaxmp.hlo import KINDS
from jaxmp.tools import charts
from jaxmp.tools.bench_rows import Bench, Row

CHARTS = ("memory.png", "collectives.png", "step_time.png")


def finite(x: Any) -> Any:
    """``x`` with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def json_text(result: Bench) -> str:
    return json.dumps(finite(result.to_json()), indent=2) + "\n"


def _err(row: Row, key: str) -> str:
    e = (row.predicted or {}).get("rel_err", {}).get(key)
    return "" if e is None or not math.isfinite(e) else f"{e:+.0%}"


def _pred(row: Row, key: str, fmt: Any) -> str:
    v = (row.predicted or {}).get(key)
    return "" if v is None else fmt(v)


def _label(row: Row) -> str:
    return f"{row.name} (= {row.same_as})" if row.same_as else row.name


def _opt(v: float | None, fmt: Any) -> str:
    return "—" if v is None else fmt(v)


def render(result: Bench) -> str:
    """The tables of bench.md: measured beside predicted, collectives by kind, what did not run."""
    b = result
    model = b.description.get("model")
    head = [f"# jaxmp bench: {b.n_devices} {b.platform} device(s) ({b.device_kind})", ""]
    if model:
        batch = b.description.get("global_batch", {})
        head.append(f"Model: {model['layers']} layers × d_model {model['d_model']}, "
                    f"{model['heads']} heads, vocab {model['vocab_size']}, "
                    f"{model['compute_dtype']}, remat {model['remat']}; "
                    f"{fmt_bytes(b.param_bytes)} of parameters. "
                    f"Global batch {batch.get('sequences')} × {batch.get('seq_len')} tokens.")
    ran = [r for r in b.rows if r.peak_bytes is not None]
    # --aot: every step compiled, none run — no step was timed
    compiled_only = bool(ran) and all(r.status == "compiled only" for r in ran)
    timed = "Step time: not measured (compiled, not run); " if compiled_only else \
        f"Step time: median of {b.steps} steps after {b.warmup} warm-up steps. "
    head.append(f"{b.tokens_per_step:,} tokens and {fmt_flops(b.model_flops_per_step)} of model "
                f"FLOPs per step; MFU against {fmt_flops(b.peak_flops)}/s "
                f"({'a matmul measured in this run' if b.platform == 'cpu' else 'device peak'}). "
                f"{timed}Predicted (pred) is the planner's figure for the same layout; err = "
                f"predicted / {'compiled' if compiled_only else 'measured'} − 1.")
    rows = []
    for r in ran:
        rows.append([_label(r), mesh_str(r.mesh),
                     fmt_bytes(r.peak_bytes), _pred(r, "peak_bytes", fmt_bytes),
                     _err(r, "peak_bytes"), fmt_bytes(r.argument_bytes),
                     _pred(r, "argument_bytes", fmt_bytes), _err(r, "argument_bytes"),
                     fmt_bytes(r.collective_bytes_total),
                     _pred(r, "collective_bytes_total", fmt_bytes),
                     _err(r, "collective_bytes_total"), _opt(r.step_time_s, fmt_time),
                     _pred(r, "step_time_s", fmt_time), _err(r, "step_time_s"),
                     _opt(r.tokens_per_s, lambda v: f"{v:,.0f}"),
                     _opt(r.mfu, lambda v: f"{v:.1%}")])
    out = head + ["", f"## {'Compiled' if compiled_only else 'Measured'} and predicted, per "
                      "device", ""]
    out += md_table(["strategy", "mesh", "peak", "pred", "err", "arguments", "pred", "err",
                     "sent/step", "pred", "err", "step time", "pred", "err", "tokens/s",
                     "MFU"], rows, right=set(range(2, 16)))
    kinds = [k for k in KINDS if any((r.collective_bytes or {}).get(k) for r in ran)]
    if ran:
        out += ["", "## Bytes each device sends per step, by collective", ""]
        out += md_table(["strategy", *kinds, "total", "static bound", "as compiled", "temp",
                         "compile"],
                        [[_label(r), *(fmt_bytes(r.collective_bytes[k]) for k in kinds),
                          fmt_bytes(r.collective_bytes_total),
                          _opt(r.collective_bytes_static, fmt_bytes),
                          fmt_bytes(r.collective_bytes_raw),
                          fmt_bytes(r.temp_bytes), _opt(r.compile_s, fmt_time)] for r in ran],
                        right=set(range(1, len(kinds) + 6)))
        executed = all(r.collectives_from == "executed" for r in ran)
        out += ["", ("The bytes by collective are what the busiest device executed in one "
                     "profiled step (each collective instruction's executions counted per "
                     "device, its bytes from the compiled HLO); " if executed else
                     "The bytes by collective are counted in the compiled HLO; ") +
                "\"static bound\" counts the HLO with each conditional charged its largest "
                "branch — the same for programs without conditionals; a pipeline's tick "
                "conditionals are charged on the ticks that run them, not on bubble ticks: each "
                "device its own ticks and its own chunks' embedding or head work, the busiest "
                "device reported. \"as compiled\" counts every branch and the CPU "
                "backend's all-reduce + dynamic-slice as it runs; the other columns count that "
                "as the reduce-scatter GPU and TPU compile it to."]
    warned = [r for r in ran if r.xla_rematerialization]
    if warned:
        out += ["", "XLA's rematerialization pass estimated more than its limit for: " + "; ".join(
            f"{r.name} ({fmt_bytes(r.xla_rematerialization['needed_bytes'])} against "
            f"{fmt_bytes(r.xla_rematerialization['limit_bytes'])})" for r in warned) +
            ". Information only: the fit verdict is the compiled peak's, which is what the GPU "
            "runtime allocates (docs/planner.md §7)."]
    skipped = [r for r in b.rows if r.reason]
    if skipped:
        out += ["", "## Not run" + (" (or compiled only)" if compiled_only else ""), ""]
        out += md_table(["strategy", "mesh", "why"],
                        [[r.name, mesh_str(r.mesh) if r.mesh else "—", r.reason]
                         for r in skipped])
    return "\n".join(out) + "\n"


def write_charts(result: Bench, out: Path) -> list[Path]:
    """memory.png, collectives.png and step_time.png: measured beside predicted per strategy."""
    rows = [r for r in result.rows if r.peak_bytes is not None or r.predicted]
    names = [r.name for r in rows]

    def pred(key: str) -> list[float | None]:
        return [(r.predicted or {}).get(key) for r in rows]

    gib = (2.0**30, "GiB") if max((r.peak_bytes or 0) for r in rows) > 2**30 else (2.0**20, "MiB")
    paths = [charts.stacked_pairs(
        out / CHARTS[0], "Per-device memory", "bytes", names,
        {"arguments": [r.argument_bytes for r in rows], "temporaries": [r.temp_bytes for r in rows]},
        {"arguments": pred("argument_bytes"), "temporaries": pred("temp_bytes")}, gib)]
    kinds = [k for k in KINDS if any((r.collective_bytes or {}).get(k) for r in rows)]
    by_axis = sorted({a for r in rows for a in (r.predicted or {}).get("collective_bytes_by_axis",
                                                                         {})})
    paths.append(charts.stacked_pairs(
        out / CHARTS[1], "Bytes each device sends per step", "bytes", names,
        {k: [(r.collective_bytes or {}).get(k) for r in rows] for k in kinds},
        {f"{a} axis": [(r.predicted or {}).get("collective_bytes_by_axis", {}).get(a)
                       for r in rows] for a in by_axis}, (2.0**20, "MiB")))
    paths.append(charts.stacked_pairs(
        out / CHARTS[2], "Step time", "seconds", names,
        {"step": [r.step_time_s for r in rows]}, {"step": pred("step_time_s")}))
    return paths


def write_outputs(result: Bench, out: Path, with_charts: bool = True) -> list[Path]:
    """bench.json, bench.md and (with matplotlib installed) the charts, under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [atomic_write(out / "bench.json", json_text(result))]
    md = render(result)
    pictures: list[Path] = []
    if with_charts:
        try:
            pictures = write_charts(result, out)
        except MissingDependency as e:
            md += f"\n(no charts: {e})\n"
    if pictures:
        md += "\n## Charts\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pictures) + "\n"
    written.append(atomic_write(out / "bench.md", md))
    return written + pictures
