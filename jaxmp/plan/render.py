"""The text report of a plan (``jaxmp plan`` without ``--json``)."""

from __future__ import annotations

from jaxmp._util.fmt import fmt_bytes, fmt_flops, fmt_time, mesh_str, table
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
                     f"{lay['param_count']:,.0f}", fmt_bytes(lay["saved_bytes"].get("none", 0.0)),
                     fmt_bytes(lay["boundary_bytes"])])
    return rows


def render(plan: Plan, batch: str = "") -> str:
    """The human-readable report: layer table, chosen plan, alternatives, verification.

    ``batch`` describes the global batch for the header (e.g. ``"16 x 128 tokens"``).
    """
    p, dev = plan.predicted, plan.device
    lines = [f"jaxmp plan: {plan.n_devices} x {dev.kind} (peak {dev.peak_flops:.3g} FLOP/s, "
             f"{fmt_bytes(plan.memory_limit)} usable per device)"
             + (f"; global batch {batch}" if batch else ""), "",
             "per-layer costs (whole global batch, remat none; a stack's blocks: per block):"]
    lines += table(["layer", "forward", "backward", "params", "saved", "output"],
                   _layer_rows(plan.layers), right={1, 2, 3, 4, 5})
    status = "runnable" if plan.runnable else "not runnable"
    fits = "fits" if plan.fits else "DOES NOT FIT"
    comm = ", ".join(f"{a} {fmt_time(s)}" for a, s in p.comm_s.items() if s)
    lines += ["", f"chosen: {mesh_str(plan.mesh)}  (remat {plan.remat}, {plan.microbatches} "
                  f"microbatch{'es' if plan.microbatches > 1 else ''}; {status}; {fits})",
              f"  stages {plan.stages}",
              f"  per device {fmt_bytes(p.per_device_bytes)}: params {fmt_bytes(p.param_bytes)}, "
              f"optimizer {fmt_bytes(p.optimizer_bytes)}, grads+update {fmt_bytes(p.grad_bytes)}, "
              f"activations {fmt_bytes(p.activation_bytes)}, working {fmt_bytes(p.working_bytes)}",
              f"  step {fmt_time(p.step_time_s)}: compute {fmt_time(p.compute_s)}, bubble "
              f"{fmt_time(p.bubble_s)}" + (f", {comm}" if comm else ""),
              f"  {fmt_flops(p.flops_per_step)} per step, {fmt_bytes(p.comm_bytes_per_step)} sent "
              f"per device per step"]
    if plan.alternatives:
        lines += ["", "alternatives:"]
        for i, alt in enumerate(plan.alternatives, 1):
            pred = alt["predicted"]
            lines.append(f"  {i}. {mesh_str(alt['mesh'])} (remat {alt['remat']}, "
                         f"{alt['microbatches']} mb): {fmt_time(pred['step_time_s'])}, "
                         f"{fmt_bytes(pred['per_device_bytes'])} - {alt['reason']}")
    if plan.dropped:
        lines.append("  dropped: " + "; ".join(f"{k} ({v})" for k, v in plan.dropped.items()))
    lines += [f"note: {note}" for note in plan.notes]
    if plan.verify:
        v = plan.verify
        lines += ["", f"verify (compiled on {plan.n_devices} simulated CPU devices):"]
        lines += table(["", "predicted", "compiled", "rel err"],
                       [[key, fmt_bytes(v[key]["predicted"]), fmt_bytes(v[key]["compiled"]),
                         f"{v[key]['rel_err']:.1%}"]
                        for key in ("argument_bytes", "peak_bytes", "comm_bytes_per_step")],
                       right={1, 2, 3})
    lines.append(f"\nplanned in {plan.planning_time_s:.3f} s (cost model {plan.cost_time_s:.2f} s)")
    return "\n".join(lines)
