"""A research-style Transformer LM, written the ordinary Flax NNX way, trained by jaxmp as is.

    python examples/train_research_lm.py --simulate-devices 8   # 8 CPU devices, fsdp4×tensor2
    python examples/train_research_lm.py --simulate-devices 8 --steps 300 --set mesh.fsdp=8 \
        --set mesh.tensor=1
    python examples/train_research_lm.py --set mesh.data=-1 --set mesh.fsdp=1 \
        --set mesh.tensor=1                                     # the devices present (e.g. GPUs)

``--devices N`` uses the first N devices present (default: all), ``--simulate-devices N`` gives
the CPU backend N devices first — the same two flags as ``jaxmp train``, ``plan`` and ``bench``.

The model is what an lm1b-style example looks like: stock ``nnx.Embed``,
``nnx.MultiHeadAttention``, ``nnx.LayerNorm``, ``nnx.Linear`` and ``nnx.Dropout``, parameters
annotated with ``nnx.with_partitioning(init, names)`` in the model's own logical names —
including the two-name ``("embed", "kv")`` annotation of 3-D attention kernels, which leaves the
head dim unnamed — and dropout whose randomness comes from the ``rngs`` passed at call time.
Nothing here works around jaxmp:

* the names come from an ``AxisNames`` object, the way Flax examples use a ``MeshRules``:
  ``LOGICAL`` gives logical names (``embed``, ``mlp``, ``kv``, ``vocab``) that jaxmp's rules
  resolve; ``MESH_AXES`` puts mesh-axis names (``fsdp``, ``tensor``) straight into the
  metadata, which jaxmp also takes as written;
* ``RULES`` maps the one logical name jaxmp's defaults do not know (``kv``) and keeps the
  defaults;
* ``lm_loss(model, batch, rngs)`` takes the per-step ``nnx.Rngs`` the Trainer derives from
  ``train.seed`` and the step, so dropout differs every step and a resumed run stays bitwise;
* the data is jaxmp's byte stream of the Python standard library (any iterator of numpy dicts
  holding this process's rows would do).
"""

from __future__ import annotations

import argparse
import sys

if __name__ == "__main__":  # --simulate-devices N: set before jax starts
    from jaxmp._util.env import simulate_devices_from_argv

    simulate_devices_from_argv(sys.argv[1:])

from dataclasses import dataclass  # noqa: E402

import jax  # noqa: E402 - after XLA_FLAGS
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxmp  # noqa: E402
from jaxmp.cli.train import add_device_arguments  # noqa: E402
from jaxmp import rules  # noqa: E402

VOCAB, D_MODEL, HEADS, LAYERS, MLP, MAX_LEN = 256, 128, 8, 2, 512, 128

# The model's own name for the attention projections' head axis, then jaxmp's defaults
# (rules= replaces the defaults everywhere in jaxmp; extend them like this).
RULES = [("kv", "tensor"), *rules.DEFAULT_RULES]

normal = nnx.initializers.normal
xavier = nnx.initializers.xavier_uniform()
ones, zeros = nnx.initializers.ones_init(), nnx.initializers.zeros_init()


@dataclass(frozen=True)
class AxisNames:
    """What each role of a dim is called in the metadata (Flax examples call this MeshRules)."""

    embed: str | None = "embed"
    mlp: str | None = "mlp"
    kv: str | None = "kv"
    vocab: str | None = "vocab"

    def __call__(self, *roles: str | None) -> tuple[str | None, ...]:
        return tuple(getattr(self, r) if r else None for r in roles)


LOGICAL = AxisNames()
MESH_AXES = AxisNames(embed="fsdp", mlp="tensor", kv="tensor", vocab="tensor")


def layer_norm(names: AxisNames, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(D_MODEL, scale_init=nnx.with_partitioning(ones, names("embed")),
                         bias_init=nnx.with_partitioning(zeros, names("embed")), rngs=rngs)


def dense(n_in: int, n_out: int, names: tuple[str | None, ...], rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, kernel_init=nnx.with_partitioning(xavier, names),
                      bias_init=nnx.with_partitioning(zeros, names[1:]), rngs=rngs)


class Block(nnx.Module):
    """Pre-norm block: self-attention then an MLP, each with dropout on the residual branch."""

    def __init__(self, dropout: float, names: AxisNames, rngs: nnx.Rngs):
        self.ln1 = layer_norm(names, rngs)
        self.attn = nnx.MultiHeadAttention(
            HEADS, D_MODEL, dropout_rate=dropout, decode=False, deterministic=False,
            kernel_init=nnx.with_partitioning(xavier, names("embed", "kv")),  # 3-D, 2 names
            out_kernel_init=nnx.with_partitioning(xavier, names("kv", None, "embed")),
            bias_init=nnx.with_partitioning(zeros, names("kv")), rngs=rngs)
        self.ln2 = layer_norm(names, rngs)
        self.up = dense(D_MODEL, MLP, names("embed", "mlp"), rngs)
        self.down = dense(MLP, D_MODEL, names("mlp", "embed"), rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, deterministic: bool | None,
                 rngs: nnx.Rngs | None) -> jax.Array:
        h = self.attn(self.ln1(x), mask=mask, deterministic=deterministic, rngs=rngs)
        x = x + self.drop(h, deterministic=deterministic, rngs=rngs)
        h = self.down(nnx.gelu(self.up(self.ln2(x))))
        return x + self.drop(h, deterministic=deterministic, rngs=rngs)


class TransformerLM(nnx.Module):
    """Token + learned position embeddings → blocks → LayerNorm → vocabulary logits."""

    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.1, layers: int = LAYERS,
                 names: AxisNames = LOGICAL):
        self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs, embedding_init=nnx.with_partitioning(
            normal(1.0), names("vocab", "embed")))
        self.pos = nnx.Embed(MAX_LEN, D_MODEL, rngs=rngs, embedding_init=nnx.with_partitioning(
            normal(0.02), names(None, "embed")))
        self.blocks = nnx.List([Block(dropout, names, rngs) for _ in range(layers)])
        self.ln_f = layer_norm(names, rngs)
        self.head = dense(D_MODEL, VOCAB, names("embed", "vocab"), rngs)

    def __call__(self, tokens: jax.Array, *, deterministic: bool | None = None,
                 rngs: nnx.Rngs | None = None) -> jax.Array:
        """``deterministic=None`` leaves dropout to the modules' mode (``model.eval()``)."""
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask, deterministic, rngs)
        return self.head(self.ln_f(x))


def lm_loss(model: TransformerLM, batch: dict, rngs: nnx.Rngs) -> tuple[jax.Array, dict]:
    """Next-token cross entropy; ``rngs`` is the Trainer's fresh per-step randomness."""
    logits = model(batch["inputs"], rngs=rngs).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return loss, {"weight": jnp.float32(batch["targets"].size)}


DEFAULTS = ["mesh.fsdp=4", "mesh.tensor=2", "mesh.data=1", "mesh.stage=1",
            "train.batch_size=16", "data.seq_len=64", "train.eval_every=0",
            "optimizer.lr=3e-3", "optimizer.warmup_steps=5", "logging.every=5"]


def make_config(steps: int, overrides: list[str] = ()) -> jaxmp.Config:
    """jaxmp's GPT config is used only for its [data] section (the byte stream below)."""
    return jaxmp.load_config(None, overrides=[*DEFAULTS, f"train.steps={steps}", *overrides])


def make_trainer(config: jaxmp.Config, run_dir: str, devices=None,
                 dropout: float = 0.1) -> jaxmp.Trainer:
    d, t = config.data, config.train
    data = jaxmp.data.make_batches(d.source, seq_len=d.seq_len, global_batch=t.batch_size,
                                   seed=t.seed, vocab_size=VOCAB)
    return jaxmp.Trainer(config, model_fn=lambda r: TransformerLM(r, dropout=dropout),
                         loss_fn=lm_loss, data=data, rules=RULES, run_dir=run_dir,
                         devices=devices)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_arguments(p, "to train on: the first N present")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--run-dir", default="runs/research-lm")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any jaxmp config key, e.g. mesh.fsdp=8 or checkpoint.every=20")
    args = p.parse_args(argv)
    devices = jax.devices()[:args.devices] if args.devices else None
    trainer = make_trainer(make_config(args.steps, args.set), args.run_dir, devices)
    final = trainer.fit()
    if trainer.is_main and trainer.history:
        first = trainer.history[0]
        print(f"train_research_lm: loss {first['loss']:.3f} at step {first['step']} → "
              f"{final['loss']:.3f} at step {final['step']}; metrics in "
              f"{args.run_dir}/metrics.jsonl")
    return final


if __name__ == "__main__":
    try:
        main()
    except jaxmp.errors.BadInput as e:  # e.g. a mesh that does not fit the devices
        print(f"train_research_lm: error: {e}", file=sys.stderr)
        sys.exit(2)
