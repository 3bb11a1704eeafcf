"""``jaxmp train [CONFIG] [--set k=v ...] [--run-dir DIR] [--simulate-devices N]``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from jaxmp.errors import UsageError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    t = subparsers.add_parser("train", help="train the configured model "
                                            "(default: configs/tiny.toml)")
    add_config_arguments(t)
    t.add_argument("--run-dir", default="runs/default",
                   help="where outputs go (default %(default)s); without CONFIG, a run "
                        "directory that has a config.toml continues with it")
    t.add_argument("--init-from", default=None, metavar="HF_DIR",
                   help="start from a Hugging Face Llama / Mistral / Qwen2 folder: imported "
                        "into the run directory (unless it already has checkpoints), then "
                        "fine-tuned; its config.json sets [model]")
    t.add_argument("--simulate-devices", type=int, default=None, metavar="N",
                   help="run on N simulated CPU devices (try a mesh on a laptop)")
    t.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-process: address of process 0")
    t.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="multi-process: how many processes the run has")
    t.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="multi-process: this process's index, 0 to N-1")
    t.add_argument("--heartbeat-timeout", type=int, default=30, metavar="S",
                   help="multi-process: seconds without heartbeats after which a process "
                        "counts as lost and the others stop (default %(default)s)")
    t.add_argument("--join-timeout", type=int, default=300, metavar="S",
                   help="multi-process: seconds to wait at start-up for every process to "
                        "join (default %(default)s)")
    t.set_defaults(func=run)
    return t


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """``[CONFIG.toml] [--set key=value ...]``, as every command that loads a config takes them."""
    p.add_argument("config", nargs="?", default=None, help="TOML config (default: built-in tiny)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")


def simulate(n: int | None) -> None:
    """``--simulate-devices N``: N simulated CPU devices, set before jax's backend starts (in
    a process where it already started, as in tests, N CPU devices must already be there)."""
    from jaxmp._util.env import simulate_devices

    if n is None:
        return
    try:
        simulate_devices(n)
    except ValueError as e:
        raise UsageError(f"--simulate-devices: {e}") from None
    except RuntimeError as e:
        import jax  # started already: only look

        if jax.devices()[0].platform != "cpu" or jax.device_count() < n:
            raise UsageError(f"--simulate-devices: {e}") from None


def add_device_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """``--devices N`` and ``--simulate-devices N``, one meaning in every command."""
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help=f"the number of devices {what} (default: all present)")
    p.add_argument("--simulate-devices", type=int, default=None, metavar="N",
                   help="run on N simulated CPU devices (try a mesh without accelerators)")


def device_count(args: argparse.Namespace) -> int:
    """``--devices``, else the simulated count, else every device present (starts jax)."""
    if args.devices is not None:
        if args.devices < 1:
            raise UsageError(f"--devices must be >= 1, got {args.devices}")
        return args.devices
    if args.simulate_devices is not None:
        return args.simulate_devices
    import jax

    return jax.device_count()


def present_devices(n: int, flag: str = "--devices") -> list:
    """The first ``n`` devices present; too few is bad input naming ``--simulate-devices``."""
    import jax

    have = jax.devices()
    if len(have) < n:
        raise UsageError(f"{flag} {n}: this process has {len(have)} {have[0].platform} "
                         f"device(s); add --simulate-devices {n} to simulate them on the CPU")
    return list(have[:n])


def _init_distributed(args: argparse.Namespace) -> None:
    """Join a multi-process run: explicit flags, or auto-detected under SLURM / Open MPI."""
    explicit = args.coordinator is not None
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ
    mpi = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    if not (explicit or slurm or mpi):
        return
    if explicit and (args.num_processes is None or args.process_id is None):
        raise UsageError("--coordinator needs --num-processes and --process-id")
    for flag in ("heartbeat_timeout", "join_timeout"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    from jaxmp.train import peers

    peers.join(args.coordinator, args.num_processes, args.process_id,
               heartbeat_timeout_s=args.heartbeat_timeout, join_timeout_s=args.join_timeout,
               run_dir=args.run_dir)


def _import(hf_dir: str, run_dir: str, config: Any) -> None:
    """``--init-from``: import into the run directory, unless a rerun finds checkpoints there
    (then the run resumes, as a rerun of any training command does)."""
    from jaxmp._util.log import say
    from jaxmp.checkpoint import store
    from jaxmp.recipes.hf import import_run

    ckdir = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(ckdir) and store.complete_steps(store.checkpoints_dir(ckdir)):
        say(f"jaxmp: {run_dir} already has checkpoints: resuming it (--init-from {hf_dir} is "
            f"not imported again)")
        return
    summary = import_run(hf_dir, run_dir, config, into_existing=True)
    say(f"jaxmp: imported {hf_dir} ({summary['architecture']}, {summary['tensors']} tensors) "
        f"in {summary['seconds']:.1f} s")


def apply_precision(config: Any) -> None:
    """``xla.matmul_precision`` as jax's default (after ``xla.flags`` reached XLA_FLAGS)."""
    import jax

    if config.xla.matmul_precision != "default":
        jax.config.update("jax_default_matmul_precision", config.xla.matmul_precision)


def gpu_memory_fraction(config: Any) -> float:
    """The share of each GPU's memory JAX's allocator may take: ``device.usable_fraction``,
    else the profile's (``device.kind``), else the GPU profiles' common default. The planner
    fills the same share, so what it plans and what the allocator gives are one number."""
    from jaxmp.devices import PROFILES, match_kind

    if config.device.usable_fraction:
        return float(config.device.usable_fraction)
    name = match_kind(config.device.kind) if config.device.kind not in ("", "auto") else None
    return PROFILES[name or "H100"].usable_fraction  # an unknown GPU: the GPU profiles' 0.75


def _config_path(args: argparse.Namespace) -> str | None:
    """CONFIG, else the run directory's own config.toml (a run continues as it was set up,
    e.g. by ``jaxmp ckpt import``), else None (the built-in defaults)."""
    if args.config is not None:
        return args.config
    own = os.path.join(args.run_dir, "config.toml")
    if os.path.isfile(own):
        print(f"jaxmp: config from {own} (give a CONFIG to replace it)", file=sys.stderr)
        return own
    return None


def run(args: argparse.Namespace) -> int:
    from jaxmp._util.env import (add_xla_flags, limit_malloc_arenas, may_use_gpu,
                                 set_gpu_memory_fraction)

    path, overrides = _config_path(args), args.set or []
    if args.init_from is not None:
        from jaxmp.recipes.hf import hf_config

        config = hf_config(args.init_from, path, overrides)
    else:
        from jaxmp.recipes.gpt_config import load_config

        config = load_config(path, overrides=overrides)
    # Orbax reports a failed background write as absl ERROR lines with tracebacks; jaxmp
    # reports it itself, in one line (jaxmp.train.checkpointing).
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    limit_malloc_arenas()  # before jax's threads: host memory stays flat over long runs
    simulate(args.simulate_devices)
    if may_use_gpu():
        set_gpu_memory_fraction(gpu_memory_fraction(config))
    add_xla_flags(config.xla.flags)
    _init_distributed(args)
    apply_precision(config)
    if args.init_from is not None:
        _import(args.init_from, args.run_dir, config)
    from jaxmp.recipes.gpt import gpt_trainer

    trainer = gpt_trainer(config, args.run_dir)
    final = trainer.fit()
    if trainer.is_main and final:
        extra = f", eval loss {final['eval_loss']:.4f}" if final.get("eval_loss") else ""
        print(f"jaxmp: done at step {final['step']}: loss {final['loss']:.4f}{extra}; "
              f"metrics in {args.run_dir}/metrics.jsonl")
    return 0
