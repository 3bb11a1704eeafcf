"""The built-in recipe: GPT + next-token loss + jaxmp.data, fed to the same ``Trainer``.

``jaxmp train`` is ``gpt_trainer(config, run_dir).fit()``; nothing here is special-cased in the
trainer, which is how research code with its own model uses it too.
"""

from __future__ import annotations

import os
from typing import Callable

from flax import nnx

from jaxmp.config import Config
from jaxmp.data import make_batches
from jaxmp.models import GPT, GPTConfig, lm_loss
from jaxmp.train.loop import Trainer


def gpt_config(config: Config) -> GPTConfig:
    """Resolve the model section (zeros meaning 'derive it') into a concrete GPTConfig."""
    m = config.model
    return GPTConfig(
        vocab_size=m.vocab_size, layers=m.layers, d_model=m.d_model, heads=m.heads,
        kv_heads=m.resolved_kv_heads, head_dim=m.resolved_head_dim, mlp_dim=m.resolved_mlp_dim,
        activation=m.activation, tie_embeddings=m.tie_embeddings, scan_layers=m.scan_layers,
        remat=m.remat, compute_dtype=m.compute_dtype, param_dtype=m.param_dtype,
        norm_eps=m.norm_eps, init_std=m.init_std)


def gpt_model_fn(config: Config) -> Callable[[nnx.Rngs], GPT]:
    cfg = gpt_config(config)
    return lambda rngs: GPT(cfg, rngs=rngs)


def lm_batches(config: Config, split: str = "train", seed_offset: int = 0):
    d, t = config.data, config.train
    return make_batches(d.source, seq_len=d.seq_len, global_batch=t.batch_size,
                        seed=t.seed + seed_offset, vocab_size=config.model.vocab_size,
                        split=split, token_dtype=d.token_dtype, eval_fraction=d.eval_fraction)


def gpt_trainer(config: Config, run_dir: str | os.PathLike) -> Trainer:
    """A Trainer for the configured GPT on the configured token source."""
    cfg = gpt_config(config)
    plan = None
    if config.mesh.is_auto:  # the planner picks the mesh from the cost model
        import jax

        from jaxmp.planner import plan_for_config

        # measure_cpu=False: every process of a multi-host run must reach the same plan
        plan = plan_for_config(config, jax.device_count(), remats=(config.model.remat,),
                               measure_cpu=False, strict=False).to_json()
    eval_data = None
    if config.train.eval_every > 0 and config.data.source != "synthetic":
        eval_data = lambda: lm_batches(config, split="eval")  # noqa: E731 - fresh, same batches
    return Trainer(config, gpt_model_fn(config), lm_loss, lm_batches(config), run_dir=run_dir,
                   eval_data=eval_data, plan=plan,
                   model_flops_per_token=cfg.flops_per_token(config.data.seq_len))
