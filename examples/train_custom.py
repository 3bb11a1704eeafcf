"""Train your own Flax NNX model with jaxmp: a small conv classifier on synthetic images.

    python examples/train_custom.py --simulate-devices 8     # 8 CPU devices, data2×fsdp2×tensor2
    python examples/train_custom.py --simulate-devices 8 --steps 200 --set mesh.tensor=1 \
        --set mesh.fsdp=4
    python examples/train_custom.py --set mesh.data=-1 --set mesh.fsdp=1 \
        --set mesh.tensor=1                                  # the devices present (e.g. GPUs)

``--devices N`` uses the first N devices present (default: all), ``--simulate-devices N`` gives
the CPU backend N devices first — the same two flags as ``jaxmp train``, ``plan`` and ``bench``.

Nothing here is GPT-specific, and nothing in the model mentions a mesh axis. The model names its
array dimensions logically, in two ways at once, to show both:

* the dense head creates its parameters with ``nnx.Param(..., out_sharding=names)`` metadata,
  using the names jaxmp's default rules already know (``embed`` → fsdp, ``mlp`` → tensor);
* the conv layers are stock ``nnx.Conv`` with no metadata; ``PATH_RULES`` names them by regex
  on their path (``conv1/kernel`` → ``(None, None, None, "conv_out")``).

``RULES`` then maps the model's own names (``conv_in``, ``conv_out``, ``classes``) onto mesh
axes, followed by ``jaxmp.rules.DEFAULT_RULES`` (``rules=`` is the complete list everywhere in
jaxmp, so extending the defaults means appending them); first free match wins.

The data are images ``prototype[label] + noise``: ten fixed random "teacher" prototypes, so the
loss falls from ln 10 ≈ 2.30 within a few dozen steps. Each process yields only its rows of
every global batch, which is what ``jaxmp.Trainer`` expects on several hosts.
"""

from __future__ import annotations

import argparse
import sys

if __name__ == "__main__":  # --simulate-devices N: set before jax starts
    from jaxmp._util.env import simulate_devices_from_argv

    simulate_devices_from_argv(sys.argv[1:])

import jax  # noqa: E402 - after XLA_FLAGS
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxmp  # noqa: E402
from jaxmp.cli.train import add_device_arguments  # noqa: E402
from jaxmp.rules import constrain  # noqa: E402

IMAGE = (16, 16, 3)
CLASSES = 10

# The model's own logical names → mesh axes, then jaxmp's defaults.
RULES = [
    ("conv_in", "fsdp"),  # like "embed": shard the input channels of weights over fsdp...
    ("conv_out", "tensor"),  # ...and the output channels over tensor (like "mlp")
    ("classes", None),  # 10 logits: replicated
    *jaxmp.rules.DEFAULT_RULES,
]
# Names for parameters that carry no metadata (stock nnx.Conv); first matching regex wins.
PATH_RULES = [
    (r"conv1/kernel", (None, None, None, "conv_out")),  # 3 RGB input channels: not split
    (r"conv\d+/kernel", (None, None, "conv_in", "conv_out")),
    (r"conv\d+/bias", ("conv_out",)),
]


# ------------------------------------------------------------------------------------ model


class Dense(nnx.Module):
    """A linear layer whose parameters carry logical axis names as NNX metadata."""

    def __init__(self, d_in: int, d_out: int, names: tuple[str, str], *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        # eager_sharding=False: the names are only recorded; jaxmp decides the sharding.
        self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out)), out_sharding=names,
                                eager_sharding=False)
        self.bias = nnx.Param(jnp.zeros((d_out,)), out_sharding=(names[1],),
                              eager_sharding=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...] + self.bias[...]


class ConvNet(nnx.Module):
    """Two strided convolutions and a two-layer dense head: 16×16×3 image → 10 logits."""

    def __init__(self, width: int = 16, hidden: int = 128, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(IMAGE[2], width, (3, 3), strides=2, rngs=rngs)  # → 8×8×width
        self.conv2 = nnx.Conv(width, 2 * width, (3, 3), strides=2, rngs=rngs)  # → 4×4×2width
        flat = (IMAGE[0] // 4) * (IMAGE[1] // 4) * 2 * width
        self.hidden = Dense(flat, hidden, ("embed", "mlp"), rngs=rngs)
        self.out = Dense(hidden, CLASSES, ("mlp", "classes"), rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        # constrain() pins activations by logical name inside the trainer; a no-op elsewhere.
        x = constrain(nnx.relu(self.conv1(images)), ("batch", None, None, "conv_out"))
        x = constrain(nnx.relu(self.conv2(x)), ("batch", None, None, "conv_out"))
        x = x.reshape(x.shape[0], -1)
        x = constrain(nnx.relu(self.hidden(x)), ("batch", "act_mlp"))
        return self.out(x)


def classification_loss(model: ConvNet, batch: dict) -> jax.Array:
    """Mean cross entropy: ``loss_fn(model, batch) -> scalar``, all the Trainer needs."""
    logits = model(batch["images"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


# ------------------------------------------------------------------------------------- data


class TeacherImages:
    """This process's rows of a deterministic stream of labelled synthetic images.

    The global batch at step ``s`` is a function of ``(seed, s)`` alone, so every process agrees
    on it whatever the process count; process ``p`` of ``P`` keeps rows ``[p*B/P, (p+1)*B/P)``
    (a real loader would read only those). ``get_state`` / ``set_state`` let a resumed run
    continue the same stream.
    """

    def __init__(self, global_batch: int, seed: int = 0, noise: float = 3.0,
                 process_index: int | None = None, process_count: int | None = None):
        self.global_batch, self.seed, self.noise = global_batch, seed, noise
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        if global_batch % self.process_count:
            raise ValueError(f"global batch {global_batch} does not split over "
                             f"{self.process_count} processes")
        # The "teacher": one fixed random prototype per class, independent of the seed.
        self.prototypes = np.random.default_rng(1234).normal(size=(CLASSES, *IMAGE))
        self.step = 0

    def __iter__(self) -> TeacherImages:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.step])
        labels = rng.integers(0, CLASSES, self.global_batch)
        images = self.prototypes[labels] + self.noise * rng.normal(
            size=(self.global_batch, *IMAGE))
        n = self.global_batch // self.process_count
        rows = slice(self.process_index * n, (self.process_index + 1) * n)
        self.step += 1
        return {"images": images[rows].astype(np.float32), "labels": labels[rows].astype(np.int32)}

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])


# ------------------------------------------------------------------------------------ train


DEFAULTS = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.stage=1",
            "train.batch_size=32", "train.eval_every=0", "optimizer.warmup_steps=5",
            "optimizer.lr=3e-3", "logging.every=5"]


def make_config(steps: int, overrides: list[str] = ()) -> jaxmp.TrainerConfig:
    """The trainer's config sections only (defaults + ours + the user's ``--set``): this model
    has no use for the GPT recipe's ``[model]`` and ``[data]``."""
    return jaxmp.load_config(None, overrides=[*DEFAULTS, f"train.steps={steps}", *overrides],
                             schema=jaxmp.TrainerConfig)


def make_trainer(config: jaxmp.TrainerConfig, run_dir: str, devices=None) -> jaxmp.Trainer:
    t = config.train
    return jaxmp.Trainer(
        config,
        model_fn=lambda rngs: ConvNet(rngs=rngs),
        loss_fn=classification_loss,
        data=TeacherImages(t.batch_size, seed=t.seed),
        rules=RULES,
        path_rules=PATH_RULES,
        run_dir=run_dir,
        devices=devices)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_arguments(p, "to train on: the first N present")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--run-dir", default="runs/custom")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any jaxmp config key, e.g. mesh.fsdp=4 or checkpoint.every=20")
    args = p.parse_args(argv)
    devices = jax.devices()[:args.devices] if args.devices else None
    trainer = make_trainer(make_config(args.steps, args.set), args.run_dir, devices)
    final = trainer.fit()
    if trainer.is_main and trainer.history:
        first = trainer.history[0]
        print(f"train_custom: loss {first['loss']:.3f} at step {first['step']} → "
              f"{final['loss']:.3f} at step {final['step']}; metrics in "
              f"{args.run_dir}/metrics.jsonl")
    return final


if __name__ == "__main__":
    try:
        main()
    except jaxmp.ConfigError as e:  # e.g. a mesh that does not fit the devices: one line, exit 2
        print(f"train_custom: error: {e}", file=sys.stderr)
        sys.exit(2)
