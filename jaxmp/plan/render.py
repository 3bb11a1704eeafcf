"""The text report of a plan (``jaxmp plan`` without ``--json``), and ``--compare``'s table."""

from __future__ import annotations

from jaxmp._util.fmt import fmt_bytes, fmt_flops, fmt_time, mesh_str, table
from jaxmp.mesh import AXES
from jaxmp.plan.prediction import Prediction
from jaxmp.plan.plan import Plan


def _layer_rows(layers: list[dict]) -> list[list[str]]:
    """One row per layer; identical blocks of a stack (one group) collapse into one row."""
    runs: list[list[dict]] = []
    for lay in layers:
        if runs and lay.get("group", lay["name"]) == runs[-1][-1].get("group", "") \
                and lay.get("group") != lay["name"]:
            runs[-1].append(lay)
        else:
            runs.append([lay])
    rows = []
    for run in runs:
        lay = run[0]
        name = lay["name"] if len(run) == 1 else \
            f"{lay['name']}..{run[-1]['name'].rsplit('/', 1)[-1]} x{len(run)}"
        rows.append([name, fmt_flops(lay["fwd_flops"]), fmt_flops(lay["bwd_flops"]),
                     f"{lay['param_count'] / 1e6:,.1f} M",
                     fmt_bytes(lay["saved_bytes"].get("none", 0.0)),
                     fmt_bytes(lay["boundary_bytes"])])
    return rows


def state_per_param(layers: list[dict], over: int = 1, master: bool = False) -> str:
    """Bytes of training state per parameter: stored params, optimizer state (``over``: the
    data replicas it is sharded over), gradients and the update (``"20 B: params 4 +
    optimizer 8 + gradients 4 + update 4"``); ``master``: a float32 master beside 16-bit
    params (sharded like the optimizer, which is then float32 too, as are the gradients)."""
    count = sum(lay["param_count"] for lay in layers)
    if not count:
        return "no parameters"
    params = sum(lay["param_bytes"] for lay in layers) / count
    wide = 4.0 / params if master and params < 4 else 1.0
    opt = sum(lay["optimizer_bytes"] for lay in layers) / count * wide / over
    sharded = f" (sharded over data {over})" if over > 1 else ""
    if wide > 1:
        return (f"{params + 4 / over + opt + 4 + 4 / over:.3g} B per parameter: params "
                f"{params:.3g} + float32 master {4 / over:.3g}{sharded} + optimizer {opt:.3g} + "
                f"gradients 4 + update {4 / over:.3g}")
    return (f"{2 * params + opt + params:.3g} B per parameter: params {params:.3g} + optimizer "
            f"{opt:.3g}{sharded} + gradients {params:.3g} + update {params:.3g}")


def _parts(parts: dict[str, float]) -> str:
    return " + ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items() if v)


def _summary(p: Prediction, limit: float) -> list[str]:
    comm = ", ".join(f"{a} {fmt_time(p.comm_s[a])}"
                     + (f" ({fmt_time(p.comm_hidden_s[a])} hidden)"
                        if p.comm_hidden_s.get(a) else "")
                     for a in AXES if p.comm_s[a] or p.comm_hidden_s.get(a))
    return [f"  per device {fmt_bytes(p.per_device_bytes)} of {fmt_bytes(limit)}: params "
            f"{fmt_bytes(p.param_bytes)}, optimizer {fmt_bytes(p.optimizer_bytes)}, grads+update "
            f"{fmt_bytes(p.grad_bytes)}, activations {fmt_bytes(p.activation_bytes)}, working "
            f"{fmt_bytes(p.working_bytes)}, batch {fmt_bytes(p.batch_bytes)}",
            f"    activations: {_parts(p.activation_parts)}",
            f"    working (one layer's backward, the largest): {_parts(p.working_parts)}",
            f"  step {fmt_time(p.step_time_s)}: compute {fmt_time(p.compute_s)}, bubble "
            f"{fmt_time(p.bubble_s)}" + (f"; communication shown: {comm}" if comm else ""),
            f"  {fmt_flops(p.flops_per_step)} per step ({fmt_flops(p.flops_per_device)} per "
            f"device), {fmt_bytes(p.comm_bytes_per_step)} sent per device per step"]


def _stages(p: Prediction) -> str:
    if not p.blocks_per_chunk:
        return f"  layers {p.stages[0][0]}..{p.stages[0][1] - 1} on every device"
    return (f"  {len(p.stages)} chunks {p.stages} (chunk c on stage c % stages), blocks per "
            f"chunk {p.blocks_per_chunk}")


def render(plan: Plan, batch: str = "") -> str:
    """The human-readable report: layer table, chosen plan, alternatives, verification.

    ``batch`` describes the global batch for the header (e.g. ``"16 x 128 tokens"``).
    """
    p, dev = plan.predicted, plan.device
    lines = [f"jaxmp plan: {plan.n_devices} x {dev.kind} (peak {fmt_flops(dev.peak_flops)}/s, "
             f"{dev.efficiency:.0%} of it achievable"
             + (f", weight matmuls up to {dev.matmul_ceiling:.0%} by width"
                if dev.matmul_ceiling else "")
             + f"; {fmt_bytes(plan.memory_limit)} usable per "
             f"device)" + (f"; global batch {batch}" if batch else ""), "",
             "per-layer costs (whole global batch, remat none; a stack's blocks: per block):"]
    lines += table(["layer", "forward", "backward", "params", "saved", "output"],
                   _layer_rows(plan.layers), right={1, 2, 3, 4, 5})
    over = plan.mesh.get("data", 1) if plan.layout.optimizer_sharding == "data" else 1
    master = plan.layout.master_weights != "none"
    lines += ["", f"training state: {state_per_param(plan.layers, over, master)}"]
    status = "runnable" if plan.runnable else "not runnable: " + "; ".join(plan.blockers)
    fits = "fits" if plan.fits else "DOES NOT FIT"
    settings = plan.describe()
    lines += ["", f"chosen: {mesh_str(plan.mesh)}  ({settings}; {status}; {fits})",
              _stages(p)] + _summary(p, plan.memory_limit)
    if plan.alternatives:
        lines += ["", "alternatives:"]
        for i, alt in enumerate(plan.alternatives, 1):
            pred = alt["predicted"]
            lines.append(f"  {i}. {mesh_str(alt['mesh'])} ({alt['settings']}): "
                         f"{fmt_time(pred['step_time_s'])}, "
                         f"{fmt_bytes(pred['per_device_bytes'])} - {alt['reason']}")
    if plan.dropped:
        lines.append("  dropped: " + "; ".join(f"{k} ({v})" for k, v in plan.dropped.items()))
    lines += [f"note: {note}" for note in plan.notes]
    if plan.verify:
        lines += ["", *_verify_lines(plan.verify, plan.n_devices)]
    lines.append(f"\nplanned in {plan.planning_time_s:.3f} s (cost model {plan.cost_time_s:.2f} s)")
    return "\n".join(lines)


def _verify_lines(v: dict, n: int) -> list[str]:
    """``--verify``'s section: predicted vs compiled rows; with ``--aot`` also the fit verdicts
    and the async collectives (overlapped / exposed) per kind."""
    backend = v.get("backend", f"{n} devices")
    lines = [f"verify (the Trainer built from this plan, its layout as planned, its step "
             f"compiled: {backend}):"]
    lines += table(["", "predicted", "compiled", "rel err"],
                   [[key, fmt_bytes(v[key]["predicted"]), fmt_bytes(v[key]["compiled"]),
                     f"{v[key]['rel_err']:.1%}"]
                    for key in ("argument_bytes", "peak_bytes", "comm_bytes_per_step")],
                   right={1, 2, 3})
    if "fits" in v:
        short = v.get("xla_rematerialization")
        xla = (f" (XLA's rematerialization pass estimated {fmt_bytes(short['needed_bytes'])} "
               f"against its limit of {fmt_bytes(short['limit_bytes'])}: information, the "
               f"runtime allocates the compiled peak)" if short else "")
        lines.append(f"fits in {fmt_bytes(v['memory_limit_bytes'])} per device: compiled "
                     f"{'yes' if v['fits'] else 'NO'}, predicted "
                     f"{'yes' if v['predicted_fits'] else 'NO'}; compiled in "
                     f"{v['compile_s']:.1f} s{xla}")
    if "collectives" in v:
        c = v["collectives"]
        lines += table(["collective", "bytes/device", "async", "overlapped", "exposed", "sync"],
                       [[k, fmt_bytes(r["bytes"]), r["async"], r["overlapped"], r["exposed"],
                         r["sync"]] for k, r in c["by_kind"].items()], right={1, 2, 3, 4, 5})
        lines.append(f"all-gathers in the layer loop: {c['loop_all_gathers']}, exposed "
                     f"{c['loop_all_gathers_exposed']}")
    if v.get("hlo_file"):
        lines.append(f"compiled HLO written to {v['hlo_file']}")
    return lines


def _rows(chosen: Prediction, given: Prediction) -> list[tuple[str, float, float, str]]:
    rows = [("per device", chosen.per_device_bytes, given.per_device_bytes, "b"),
            ("  params", chosen.param_bytes, given.param_bytes, "b"),
            ("  optimizer", chosen.optimizer_bytes, given.optimizer_bytes, "b"),
            ("  grads+update", chosen.grad_bytes, given.grad_bytes, "b"),
            ("  activations", chosen.activation_bytes, given.activation_bytes, "b"),
            ("  working", chosen.working_bytes, given.working_bytes, "b"),
            ("  batch", chosen.batch_bytes, given.batch_bytes, "b"),
            ("step time", chosen.step_time_s, given.step_time_s, "t"),
            ("  compute", chosen.compute_s, given.compute_s, "t"),
            ("  bubble", chosen.bubble_s, given.bubble_s, "t")]
    for axis in AXES:
        rows.append((f"  {axis} (shown)", chosen.comm_s[axis], given.comm_s[axis], "t"))
        if chosen.comm_hidden_s.get(axis) or given.comm_hidden_s.get(axis):
            rows.append((f"  {axis} (hidden)", chosen.comm_hidden_s.get(axis, 0.0),
                         given.comm_hidden_s.get(axis, 0.0), "t"))
    rows += [("sent per device", chosen.comm_bytes_per_step, given.comm_bytes_per_step, "b"),
             ("FLOPs per step", chosen.flops_per_step, given.flops_per_step, "f")]
    return rows


def render_compare(plan: Plan, given: Plan) -> str:
    """The chosen plan beside ``given`` (the same planning call with more keys fixed: ``jaxmp
    plan --compare``), term by term."""
    fmt = {"b": fmt_bytes, "t": fmt_time, "f": fmt_flops}
    c = given.predicted
    head = [f"{mesh_str(plan.mesh)}", f"{mesh_str(given.mesh)}"]
    settings = [plan.describe(), given.describe()]
    fits = ["fits" if plan.fits else "DOES NOT FIT", "fits" if given.fits else "DOES NOT FIT"]
    status = ["runnable" if plan.runnable else "not runnable",
              "runnable" if given.runnable else "not runnable: " + "; ".join(given.blockers)]
    rows = [["settings", *settings, ""], ["", *fits, ""], ["", *status, ""]]
    for name, a, b, kind in _rows(plan.predicted, c):
        diff = b - a
        rows.append([name, fmt[kind](a), fmt[kind](b),
                     ("+" if diff > 0 else "") + fmt[kind](diff) if diff else "="])
    ratio = c.step_time_s / plan.predicted.step_time_s if plan.predicted.step_time_s else 0.0
    lines = ["compare (per device, per step; the given settings, the rest planned):"]
    lines += table(["", "chosen: " + head[0], "given: " + head[1], "given - chosen"], rows,
                   right={1, 2, 3})
    lines.append(f"  the given layout takes {ratio:.2f}x the chosen plan's step time")
    return "\n".join(lines)
