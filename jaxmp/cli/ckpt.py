"""``jaxmp ckpt list|inspect|export``: argument parsing only; the work is in
:mod:`jaxmp.checkpoint.inspect` and (``export --format llama``) :mod:`jaxmp.checkpoint.llama`.

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
    ls.add_argument("dir", metavar="RUN_OR_CKPT_DIR")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_list)

    ins = sub.add_parser("inspect", help="arrays: shapes, dtypes, logical axes, saved sharding")
    ins.add_argument("dir", metavar="RUN_OR_CKPT_DIR")
    ins.add_argument("--step", type=int, default=None, help="default: latest complete step")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.add_argument("--digest", action="store_true",
                     help="sha256 of each array's full value (little-endian, C order)")
    ins.set_defaults(func=cmd_inspect)

    ex = sub.add_parser("export", help="write one single-host .safetensors file, or a Hugging "
                                       "Face Llama folder")
    ex.add_argument("dir", metavar="RUN_OR_CKPT_DIR")
    ex.add_argument("--step", type=int, default=None, help="default: latest complete step")
    ex.add_argument("--out", required=True, metavar="FILE.safetensors|DIR",
                    help="the .safetensors file; with --format llama, a folder")
    ex.add_argument("--format", choices=("safetensors", "llama"), default="safetensors",
                    help="jaxmp's own names (default), or HF Llama's model.safetensors + "
                         "config.json (a GPT with swiglu and an untied head)")
    ex.add_argument("--what", choices=("params", "state"), default="params",
                    help="params only (default) or every array, optimizer state included")
    ex.add_argument("--json", action="store_true", help="print the summary as JSON")
    ex.set_defaults(func=cmd_export)
    return p


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
    _quiet_orbax()
    from jaxmp.checkpoint import inspect as tools
    from jaxmp.checkpoint.llama import export_llama
    from jaxmp.errors import UsageError

    if args.format == "llama":
        if args.what != "params":
            raise UsageError("--format llama exports params only (drop --what state)")
        summary = export_llama(args.dir, args.out, args.step)
        count = f"{summary['tensors']} Llama tensors"
    else:
        summary = tools.export_safetensors(args.dir, args.out, args.step, what=args.what)
        count = f"{summary['arrays']} arrays"
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"jaxmp: wrote {count} ({fmt_bytes(summary['bytes'])}) of step {summary['step']} "
              f"to {summary['out']}", file=sys.stderr)
    return 0
