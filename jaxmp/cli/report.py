"""``jaxmp report RUN_DIR [RUN_DIR ...] [--out DIR]``: a run's metrics as PNG plots and report.md."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report", help="plot runs: loss, eval loss, tokens/s, MFU, grad norm (needs matplotlib)",
        description="Draw PNG plots of one or more run directories (overlaid) and write "
                    "report.md with their config, plan and final numbers. Needs the optional "
                    "extra: pip install 'jaxmp[report]'.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories to show")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the PNGs and report.md go (default: FIRST_RUN_DIR/report)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from jaxmp.tools.report import write_report

    for path in write_report(args.runs, args.out):
        print(f"wrote {path}")
    return 0
