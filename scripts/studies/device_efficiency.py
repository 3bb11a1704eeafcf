"""The fraction of the device's peak FLOP/s a large matmul and a GPT's training pass reach.

The planner's time model divides FLOPs by ``peak_flops x efficiency`` (docs/planner.md,
"Device profiles"); this measures the efficiency on the device present.

    python scripts/measure.py device-efficiency [--set KEY=VALUE ...] [--repeats N]

On a CPU the profile's peak is itself a measured matmul rate (``jaxmp.devices``), so the number
that matters is the model's rate over the matmul rate; on a GPU both are printed against the
datasheet peak of its profile. Runs on one device; nothing is simulated.
"""

from __future__ import annotations

import argparse
import statistics

from studies.common import times

DOC = "docs/planner.md"
DEVICES = False
# The model measured by default: big enough that matmuls dominate, small enough for 2 CPU cores.
DEFAULT = ["model.layers=2", "model.d_model=512", "model.heads=8", "model.vocab_size=1024",
           "data.seq_len=256", "train.batch_size=8", "data.source=synthetic"]


def _best(fn, args, repeats: int) -> tuple[float, list[float]]:
    """The fastest of ``repeats`` timed calls (after a compiling one), and all of them."""
    samples = times(fn, args, repeats)
    return min(samples), samples


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--repeats", type=int, default=5)


def run(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxmp.devices import detected_kind, profile_for
    from jaxmp.models import lm_loss
    from jaxmp.recipes.gpt import example_batch, gpt_costs, gpt_model_fn
    from jaxmp.recipes.gpt_config import load_config

    kind = detected_kind()
    on_cpu = kind == "CPU"
    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    print(f"device: {jax.devices()[0].device_kind} (profile {kind})")
    rates = {}
    for n in (1024, 2048, 4096):
        x = jnp.ones((n, n), dtype)
        best, _ = _best(jax.jit(lambda a: a @ a), (x,), args.repeats)
        rates[n] = 2 * n**3 / best
        print(f"matmul {n}^3 {jnp.dtype(dtype).name}: {rates[n] / 1e12:.3f} TFLOP/s")
    matmul = max(rates.values())

    config = load_config(None, DEFAULT + args.set)
    if not on_cpu:
        config = load_config(None, DEFAULT + ["model.compute_dtype=bfloat16"] + args.set)
    cost = gpt_costs(config, (config.model.remat,))
    flops = cost.flops_per_step(config.model.remat)
    model = gpt_model_fn(config)(nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    batch = {k: jnp.zeros(v.shape, v.dtype) for k, v in example_batch(config).items()}

    @jax.jit
    def step(params, batch):
        def loss(p):
            return lm_loss(nnx.merge(graphdef, p), batch)[0]

        return jax.value_and_grad(loss)(params)

    best, samples = _best(step, (params, batch), args.repeats)
    achieved = flops / best
    print(f"GPT forward+backward ({', '.join(args.set) or 'default shape'}): {flops:.3g} FLOP in "
          f"{best * 1e3:.1f} ms (median {statistics.median(samples) * 1e3:.1f} ms): "
          f"{achieved / 1e12:.3f} TFLOP/s")
    print(f"efficiency vs the matmul rate: {achieved / matmul:.2f}")
    if not on_cpu:
        peak = profile_for(kind).peak_flops
        print(f"efficiency vs the datasheet peak {peak:.3g}: matmul {matmul / peak:.2f}, "
              f"model {achieved / peak:.2f}")
    return 0

