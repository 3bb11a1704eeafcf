"""The built-in recipe: GPT + next-token loss + jaxmp.data, fed to the same ``Trainer``.

``jaxmp train`` is ``gpt_trainer(config, run_dir).fit()``; nothing here is special-cased in the
trainer, which is how research code with its own model uses it too. The recipe's own knowledge
is here: how its config sections become a model and a token stream, its example batch, and its
per-layer costs for the planner (traced with a scanned layer stack, which is fast for deep
models and gives the same costs).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmp._util.io import atomic_write
from jaxmp.config import replace
from jaxmp.cost import REMAT_POLICIES, ModelCost, model_costs
from jaxmp.data import STDLIB_VOCAB, BatchIterator, make_batches, padded_vocab, read_meta
from jaxmp.data.meta import META, RUN_META, TOKENIZER
from jaxmp.devices import devices_kind
from jaxmp.errors import ConfigError
from jaxmp.models import GPT, GPTConfig, lm_loss, next_token_loss
from jaxmp.models.attention import AttentionChoice, choose_attention, device_platform
from jaxmp.pipeline.chunk import PipelineSpec
from jaxmp.plan import Plan, make_plan
from jaxmp.recipes.gpt_config import Config, ModelConfig
from jaxmp.train import Trainer


def prepared_folder(config: Config) -> Path | None:
    """``data.source`` as a ``jaxmp data prepare`` folder, or None for the other sources."""
    source = config.data.source
    return Path(source) if source not in ("stdlib", "synthetic") and Path(source).is_dir() \
        else None


def resolve_data(config: Config) -> Config:
    """The config with what the data decides filled in (idempotent).

    ``model.vocab_size`` 0 means "from the data": 256 (bytes) for stdlib, synthetic and .bin
    sources; for a prepared folder, its tokenizer's size from ``meta.json`` rounded up to a
    multiple of 64 (even matmul tiles and shards; the extra ids are never sampled). A configured
    size is kept if it holds the tokenizer's ids and is bad input if it does not. A prepared
    folder also sets ``data.token_dtype`` from its ``meta.json``.
    """
    vocab, folder = config.model.vocab_size, prepared_folder(config)
    if folder is None:
        return config if vocab else replace(config, model={"vocab_size": STDLIB_VOCAB})
    meta = read_meta(folder)
    need = meta["vocab_size"]
    if vocab and vocab < need:
        raise ConfigError(f"model.vocab_size: {vocab} is smaller than the {need} tokens of the "
                          f"tokenizer in {folder / META} (set it >= {need}, or 0 for "
                          f"{padded_vocab(need)})")
    return replace(config, model={"vocab_size": vocab or padded_vocab(need)},
                   data={"token_dtype": meta["dtype"]})


def platform_of(devices: Sequence[Any] | None = None) -> str:
    """The platform a model will run on (:func:`jaxmp.models.attention.device_platform` of the
    first device; default: this process's devices). Deviceless GPU devices say ``"cuda"``."""
    return device_platform(devices[0] if devices else jax.devices()[0])


def attention_for(m: ModelConfig, platform: str | None = None) -> AttentionChoice:
    """``model.attention`` resolved for ``platform`` (default: this process's devices): the
    plan's decision (:func:`gpt_plan` records it in the layout)."""
    return choose_attention(m.attention, platform or platform_of(), m.compute_dtype,
                            m.resolved_head_dim)


def model_gpt_config(m: ModelConfig, platform: str | None = None,
                     attention: str | None = None) -> GPTConfig:
    """A ``[model]`` section as the model's own GPTConfig: each field by name, with the
    section's ``resolved_*`` value where it derives one (zeros mean "derive it"), and the
    attention kernel ``attention`` (a plan's), else the one chosen for ``platform`` (default:
    this process's devices)."""
    if not m.vocab_size:
        raise ConfigError("model.vocab_size: 0 ('from the data') has no data to come from here")
    fields = {f.name: getattr(m, f"resolved_{f.name}", getattr(m, f.name))
              for f in dataclasses.fields(GPTConfig)}
    fields["attention"] = attention or attention_for(m, platform).implementation
    return GPTConfig(**fields)


def gpt_config(config: Config, platform: str | None = None,
               attention: str | None = None) -> GPTConfig:
    """The model of a GPT config, its vocabulary resolved against the data, its attention
    kernel ``attention`` or the one chosen for ``platform``."""
    return model_gpt_config(resolve_data(config).model, platform, attention)


def gpt_model_fn(config: Config, platform: str | None = None,
                 attention: str | None = None) -> Callable[[nnx.Rngs], GPT]:
    cfg = gpt_config(config, platform, attention)
    return lambda rngs: GPT(cfg, rngs=rngs)


def example_batch(config: Config) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch's shapes: ``inputs`` and ``targets``, ``int32[batch, seq_len]``."""
    shape = (config.train.batch_size, config.data.seq_len)
    return {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32),
            "targets": jax.ShapeDtypeStruct(shape, jnp.int32)}


def lm_batches(config: Config, split: str = "train", seed_offset: int = 0) -> BatchIterator:
    config = resolve_data(config)
    d, t = config.data, config.train
    return make_batches(d.source, seq_len=d.seq_len, global_batch=t.batch_size,
                        seed=t.seed + seed_offset, vocab_size=config.model.vocab_size,
                        split=split, token_dtype=d.token_dtype, eval_fraction=d.eval_fraction)


_COST_CACHE: dict[tuple, ModelCost] = {}


def gpt_costs(config: Config, remats: Sequence[str] | None = None,
              platform: str | None = None, attention: str | None = None) -> ModelCost:
    """Per-layer costs of the configured GPT on the configured global batch (cached).

    ``remats``: the policies to cost (default, or ``"auto"``: all). ``runs_as`` is the
    configured policy (``"auto"``: the planner picks). The attention kernel traced is
    ``attention`` (a plan's), else the one chosen for ``platform`` (where the model will run;
    default this process's), traced here whatever this host is.
    """
    gcfg = gpt_config(config, platform, attention)
    if gcfg.remat == "auto":  # each layer is costed under every policy; trace it without one
        gcfg = dataclasses.replace(gcfg, remat="none")
    remats = tuple(r for r in (remats or ()) if r != "auto") or tuple(REMAT_POLICIES)
    if "none" not in remats:
        remats = ("none",) + remats  # the working set of a rematted layer needs its full size
    key = (gcfg, config.train.batch_size, config.data.seq_len)
    cached = _COST_CACHE.get(key)
    if cached is None or not set(remats) <= set(cached.layers[0].saved):
        # Trace with a scanned stack whatever the config says (one block: fast); the costs
        # are the same, only the fsdp re-gather of scanned weights depends on it.
        traced = dataclasses.replace(gcfg, scan_layers=True)
        shallow = dataclasses.replace(traced, layers=1)  # the same root code, for its trace
        cost = model_costs(lambda rngs: GPT(traced, rngs=rngs), example_batch(config), lm_loss,
                           policies=remats, root_model=lambda rngs: GPT(shallow, rngs=rngs))
        for lay in cost.layers:
            lay.in_loop = lay.kind == "block" and gcfg.scan_layers
        if len(_COST_CACHE) >= 4:
            _COST_CACHE.pop(next(iter(_COST_CACHE)))
        _COST_CACHE[key] = cost
    return dataclasses.replace(_COST_CACHE[key], runs_as=config.model.remat,
                               tensor_rings=gcfg.collective_matmul, sharded_lookup=True)


def gpt_plan(config: Config, n_devices: int, device_kind: str | None = None, *,
             remats: Sequence[str] | None = None, strict: bool = False,
             measure_cpu: bool = False, top: int = 8, find_devices_needed: bool = True,
             platform: str | None = None) -> Plan:
    """The configured GPT's plan: :func:`jaxmp.plan.make_plan` with its costs (every remat
    policy ranked when ``model.remat`` is ``auto``; ``remats``: rank these too, e.g. all for
    ``jaxmp plan``). The attention kernel is decided here, for ``platform`` (default this
    process's devices; ``"cuda"`` for a deviceless GPU compile): the costs are traced with it
    and the layout records it, which the Trainer builds. ``jaxmp train`` keeps ``strict=False, measure_cpu=False`` (every process reaches the same
    plan); ``jaxmp plan`` and ``jaxmp bench`` measure the CPU."""
    config = resolve_data(config)
    attention = attention_for(config.model, platform)  # the kernel the costs are traced with

    def planned(config: Config, attention: AttentionChoice) -> Plan:
        start = time.perf_counter()
        cost = gpt_costs(config, remats or (config.model.remat,),
                         attention=attention.implementation)
        seconds = time.perf_counter() - start
        plan = make_plan(config, cost, n_devices, device_kind=device_kind, remats=remats,
                         strict=strict, measure_cpu=measure_cpu,
                         stack_blocks=config.model.layers,
                         compute_dtype=config.model.compute_dtype, top=top,
                         find_devices_needed=find_devices_needed, attention=attention)
        plan.cost_time_s = seconds
        return plan

    return planned(config, attention)


def gpt_trainer(config: Config, run_dir: str | os.PathLike = "runs/default", *,
                devices: Sequence[Any] | None = None, plan: Plan | None = None,
                with_data: bool = True) -> Trainer:
    """A Trainer for the configured GPT on the configured token source.

    The run is planned once (:func:`gpt_plan`, or ``plan`` if given — ``jaxmp plan --verify``
    and ``jaxmp bench`` hand over the plan they print); the model is built with the plan's
    remat policy and the Trainer builds the plan's layout as is. ``with_data=False`` builds
    one that can compile its step without opening the token source. Training on a prepared
    folder copies its tokenizer into ``run_dir``, so the run samples on its own
    (``jaxmp sample``).
    """
    config = resolve_data(config)
    devices = list(devices if devices is not None else jax.devices())
    platform = platform_of(devices)
    plan = plan or gpt_plan(config, len(devices), devices_kind(config.device, devices),
                            platform=platform)
    config = replace(config, model={"remat": plan.remat})  # "auto": the plan's policy
    attention = plan.layout.attention or attention_for(config.model, platform).implementation
    if attention == "cudnn" and platform != "cuda":
        raise ConfigError(f"the plan runs cuDNN attention, which the {platform} devices given "
                          f"cannot (it was made for another platform)")
    eval_data = None
    if with_data and config.train.eval_every > 0 and config.data.source != "synthetic":
        eval_data = lambda: lm_batches(config, split="eval")  # noqa: E731 - fresh, same batches
        eval_data()  # a split too short for one batch is bad input now, not at the first eval
    if with_data:
        copy_tokenizer(config, run_dir)
    return Trainer(config, gpt_model_fn(config, attention=attention), lm_loss,
                   lm_batches(config) if with_data else None, run_dir=run_dir,
                   eval_data=eval_data, devices=devices, plan=plan,
                   cost=lambda: gpt_costs(config, (config.model.remat,), attention=attention),
                   example_batch=example_batch(config), pipeline=gpt_pipeline(config),
                   compute_dtype=config.model.compute_dtype,
                   model_flops_per_token=gpt_config(config, attention=attention).flops_per_token(
                       config.data.seq_len))


def gpt_pipeline(config: Config) -> PipelineSpec:
    """How the GPT splits into stages: embedding, the ``blocks`` stack, final norm + head +
    loss."""
    return PipelineSpec("blocks",
                        pre=lambda model, mb: model.embed_tokens(mb["inputs"]),
                        post=lambda model, x, mb: next_token_loss(model.logits(x), mb),
                        remat=config.model.remat, token_ids=("inputs",))


def copy_tokenizer(config: Config, run_dir: str | os.PathLike) -> None:
    """Copy a prepared folder's ``tokenizer.json`` and ``meta.json`` into the run directory."""
    folder = prepared_folder(config)
    if folder is None or jax.process_index() != 0:
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    for src, dest in ((TOKENIZER, TOKENIZER), (META, RUN_META)):
        atomic_write(Path(run_dir) / dest, (folder / src).read_bytes())
