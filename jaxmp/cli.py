"""The ``jaxmp`` command: parses arguments and calls library functions, nothing more.

jax is imported only after the environment is settled (``--simulate-devices`` and the config's
XLA flags must be in ``XLA_FLAGS`` before the backend starts). Bad input exits 2 with one line
on stderr; runtime failures exit 1 with a clear message.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1


class UsageError(ValueError):
    """Bad command-line input (exit 2)."""


def _add_xla_flags(flags: str) -> None:
    if flags:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()


def _simulate_devices(n: int | None) -> None:
    """Give the CPU backend ``n`` devices; must happen before jax is imported."""
    if n is None:
        return
    if n < 1:
        raise UsageError(f"--simulate-devices must be >= 1, got {n}")
    if "jax" in sys.modules:
        raise UsageError("--simulate-devices must be applied before jax is imported")
    _add_xla_flags(f"--xla_force_host_platform_device_count={n}")
    os.environ["JAX_PLATFORMS"] = "cpu"


def _init_distributed(args: argparse.Namespace) -> None:
    """Join a multi-process run: explicit flags, or auto-detected under SLURM / Open MPI."""
    import jax

    explicit = args.coordinator is not None
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ
    mpi = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    if not (explicit or slurm or mpi):
        return
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if explicit:
        if args.num_processes is None or args.process_id is None:
            raise UsageError("--coordinator needs --num-processes and --process-id")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    else:
        jax.distributed.initialize()


def _cmd_train(args: argparse.Namespace) -> int:
    from jaxmp.config import load_config

    config = load_config(args.config, overrides=args.set or [])
    _simulate_devices(args.simulate_devices)
    _add_xla_flags(config.xla.flags)
    _init_distributed(args)
    import jax

    if config.xla.matmul_precision != "default":
        jax.config.update("jax_default_matmul_precision", config.xla.matmul_precision)
    from jaxmp.recipes import gpt_trainer

    trainer = gpt_trainer(config, args.run_dir)
    final = trainer.fit()
    if trainer.is_main and final:
        extra = f", eval loss {final['eval_loss']:.4f}" if final.get("eval_loss") else ""
        print(f"jaxmp: done at step {final['step']}: loss {final['loss']:.4f}{extra}; "
              f"metrics in {args.run_dir}/metrics.jsonl")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxmp", description="A sharded trainer for JAX/Flax.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train the configured model (default: configs/tiny.toml)")
    t.add_argument("config", nargs="?", default=None, help="TOML config (default: built-in tiny)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    t.add_argument("--run-dir", default="runs/default", help="where outputs go (default %(default)s)")
    t.add_argument("--simulate-devices", type=int, default=None, metavar="N",
                   help="run on N simulated CPU devices (try a mesh on a laptop)")
    t.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-process: address of process 0")
    t.add_argument("--num-processes", type=int, default=None)
    t.add_argument("--process-id", type=int, default=None)
    t.set_defaults(func=_cmd_train)

    from jaxmp.ckpt.cli import add_ckpt_parser  # imports no jax

    add_ckpt_parser(sub)
    from jaxmp.plan.cli import add_plan_parser  # imports no jax

    add_plan_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed its one-line usage error
        return int(e.code or 0) and EXIT_BAD_INPUT
    from jaxmp.ckpt import CheckpointError
    from jaxmp.config import ConfigError
    from jaxmp.plan.errors import PlanError

    bad_input: tuple[type[BaseException], ...] = (ConfigError, UsageError, FileNotFoundError,
                                                  CheckpointError, PlanError)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head` and closed early: not a failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # noqa: BLE001 - sorted below into bad input / runtime failure
        # DataError is looked up only now: importing jaxmp.data imports jax, which must wait
        # until the command has set XLA_FLAGS (--simulate-devices).
        data = sys.modules.get("jaxmp.data")
        if isinstance(e, bad_input + ((data.DataError,) if data else ())):
            print(f"jaxmp: error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if os.environ.get("JAXMP_DEBUG"):
            raise
        print(f"jaxmp: failed: {type(e).__name__}: {e} (set JAXMP_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("jaxmp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
