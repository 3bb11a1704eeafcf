"""``jaxmp ckpt list|inspect|export|import``: argument parsing only; the work is in
:mod:`jaxmp.checkpoint.inspect`, :mod:`jaxmp.checkpoint.hf` (``export --format llama``) and
:mod:`jaxmp.recipes.hf` (``import``).

Importing this module does not import jax (the CLI builds its parser before the backend is
configured). Command functions return an exit code; bad input raises ``CheckpointError`` (a
``ValueError``), which the CLI prints as one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxmp._util.fmt import fmt_bytes


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``ckpt`` and its sub-commands to the ``jaxmp`` parser's subparsers."""
    p = subparsers.add_parser("ckpt", help="list, inspect or export checkpoints",
                              description="Look into a run's checkpoints. DIR is a run "
                                          "directory or its checkpoints/ folder.")
    sub = p.add_subparsers(dest="ckpt_command", required=True)

    ls = sub.add_parser("list", help="steps, save time, size, complete or not")
    ls.add_argument("dir", metavar="RUN_OR_CKPT_DIR", help="a run directory or its checkpoints/")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_list)

    ins = sub.add_parser("inspect", help="arrays: shapes, dtypes, logical axes, saved sharding")
    ins.add_argument("dir", metavar="RUN_OR_CKPT_DIR", help="a run directory or its checkpoints/")
    ins.add_argument("--step", type=int, default=None, help="default: latest complete step")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.add_argument("--digest", action="store_true",
                     help="sha256 of each array's full value (little-endian, C order)")
    ins.set_defaults(func=cmd_inspect)

    ex = sub.add_parser("export", help="write one single-host .safetensors file, or a Hugging "
                                       "Face Llama folder")
    ex.add_argument("dir", metavar="RUN_OR_CKPT_DIR", help="a run directory or its checkpoints/")
    ex.add_argument("--step", type=int, default=None, help="default: latest complete step")
    ex.add_argument("--out", required=True, metavar="FILE.safetensors|DIR",
                    help="the .safetensors file; with --format llama, a folder")
    ex.add_argument("--format", choices=("safetensors", "llama"), default="safetensors",
                    help="jaxmp's own names (default), or a Hugging Face Llama-family folder: "
                         "safetensors + config.json (a GPT with swiglu)")
    ex.add_argument("--what", choices=("params", "state"), default="params",
                    help="params only (default) or every array, optimizer state included")
    ex.add_argument("--architecture", default="auto", metavar="NAME",
                    help="--format llama: LlamaForCausalLM, MistralForCausalLM or "
                         "Qwen2ForCausalLM (default: the imported model's, else Qwen2 with "
                         "q/k/v biases, Llama without)")
    ex.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                    help="--format llama: tensor dtype (default: each tensor as it was "
                         "imported, else as stored)")
    ex.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                    help="--format llama: largest file (e.g. 5GB, 500MB; default %(default)s); "
                         "more files come with model.safetensors.index.json")
    ex.add_argument("--json", action="store_true", help="print the summary as JSON")
    ex.set_defaults(func=cmd_export)

    im = sub.add_parser("import", help="a Hugging Face Llama / Mistral / Qwen2 folder -> a run "
                                       "directory (then jaxmp sample / train --run-dir)")
    im.add_argument("hf_dir", metavar="HF_DIR",
                    help="config.json and model.safetensors (or its sharded index)")
    im.add_argument("--out", required=True, metavar="RUN_DIR", help="a new run directory")
    im.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="a config key of the run (e.g. model.param_dtype=bfloat16 to keep bf16 "
                         "weights as stored)")
    im.add_argument("--simulate-devices", type=int, default=None, metavar="N",
                    help="build the params on N simulated CPU devices")
    im.add_argument("--json", action="store_true", help="print the summary as JSON")
    im.set_defaults(func=cmd_import)
    return p


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10,
          "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``5GB`` → 5·10⁹ bytes (KB/MB/GB decimal, KiB/MiB/GiB binary, a bare number: bytes)."""
    from jaxmp.errors import UsageError

    number = text.strip().upper().rstrip("BKMGTI ")
    unit = text.strip().upper()[len(number):].strip()
    try:
        size = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise UsageError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or "
                         f"a number of bytes") from None
    if size < 1:
        raise UsageError(f"--max-shard-size {text!r}: must be positive")
    return int(size)


def _quiet_orbax() -> None:
    """Orbax logs INFO/WARNING lines through absl; a CLI shows only its own output."""
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # pragma: no cover
        pass


def cmd_list(args: argparse.Namespace) -> int:
    from jaxmp.checkpoint import inspect as tools

    report = tools.list_report(args.dir)
    print(json.dumps(report, indent=2) if args.json else tools.list_table(report))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    _quiet_orbax()
    from jaxmp.checkpoint import inspect as tools

    report = tools.inspect_report(args.dir, args.step, with_digest=args.digest)
    print(json.dumps(report, indent=2) if args.json else tools.inspect_table(report))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from jaxmp._util.env import return_large_frees

    return_large_frees()  # one array after another: host memory stays at one
    _quiet_orbax()
    from jaxmp.checkpoint import inspect as tools
    from jaxmp.checkpoint.hf import export_hf
    from jaxmp.errors import UsageError

    if args.format == "llama":
        if args.what != "params":
            raise UsageError("--format llama exports params only (drop --what state)")
        summary = export_hf(args.dir, args.out, args.step, architecture=args.architecture,
                            dtype=args.dtype, max_shard_bytes=parse_size(args.max_shard_size))
        count = f"{summary['tensors']} {summary['architecture']} tensors in " \
                f"{summary['files']} file(s)"
    else:
        for flag, default in (("architecture", "auto"), ("dtype", "auto"),
                              ("max_shard_size", "5GB")):
            if getattr(args, flag) != default:
                raise UsageError(f"--{flag.replace('_', '-')} needs --format llama")
        summary = tools.export_safetensors(args.dir, args.out, args.step, what=args.what)
        count = f"{summary['arrays']} arrays"
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"jaxmp: wrote {count} ({fmt_bytes(summary['bytes'])}) of step {summary['step']} "
              f"to {summary['out']}", file=sys.stderr)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from jaxmp._util.env import return_large_frees
    from jaxmp.cli.train import simulate

    return_large_frees()  # one tensor after another: host memory stays at one
    simulate(args.simulate_devices)
    _quiet_orbax()
    from jaxmp.recipes.hf import hf_config, import_run

    summary = import_run(args.hf_dir, args.out, hf_config(args.hf_dir, None, args.set or []))
    if args.json:
        print(json.dumps(summary))
    else:
        rate = summary["read_bytes"] / max(summary["seconds"], 1e-9)
        mesh = "x".join(f"{k}{v}" for k, v in summary["mesh"].items() if v > 1) or "1 device"
        print(f"jaxmp: imported {summary['tensors']} tensors ({fmt_bytes(summary['read_bytes'])})"
              f" of {summary['architecture']} onto {mesh} in {summary['seconds']:.1f} s "
              f"({fmt_bytes(rate)}/s); wrote {summary['out']} (checkpoint step 0, config.toml)",
              file=sys.stderr)
    return 0
