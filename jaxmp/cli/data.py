"""``jaxmp data prepare INPUT... --out DIR [--tokenizer ...] [--val-fraction F] [--dtype D]``.

Argument parsing only; the work is in :mod:`jaxmp.data.prepare` (imported inside the command,
so building the parser stays light).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxmp._util.fmt import fmt_bytes, fmt_time


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("data", help="prepare your own text for training",
                              description="Turn text into the token files `jaxmp train` reads.")
    sub = p.add_subparsers(dest="data_command", required=True)
    prep = sub.add_parser(
        "prepare", help="tokenize text files into train.bin / val.bin / tokenizer.json / meta.json",
        description="Tokenize text files, folders (searched recursively; hidden and binary files "
                    "skipped) or glob patterns into a folder that `jaxmp train --set "
                    "data.source=DIR` reads. Each file's last F of bytes goes to val.bin.")
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="file, folder or glob pattern")
    prep.add_argument("--out", required=True, metavar="DIR", help="output folder")
    prep.add_argument("--tokenizer", default="bytes", metavar="bytes|bpe:N|tokenizer.json",
                      help="'bytes' (ids are UTF-8 bytes, vocab 256; default), 'bpe:N' (train a "
                           "byte-level BPE of N tokens on the input) or a tokenizer.json file")
    prep.add_argument("--val-fraction", type=float, default=0.01, metavar="F",
                      help="share of each file held out for val.bin (default %(default)s)")
    prep.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"),
                      help="token file dtype (default: uint16 when the vocab fits, else uint32)")
    prep.add_argument("--json", action="store_true", help="print meta.json instead of a summary")
    prep.set_defaults(func=cmd_prepare)
    return p


def cmd_prepare(args: argparse.Namespace) -> int:
    from jaxmp.data.prepare import prepare

    meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer,
                   val_fraction=args.val_fraction, dtype=args.dtype,
                   progress=sys.stderr.isatty() and not args.json)
    if args.json:
        print(json.dumps(meta, indent=1))
        return 0
    tokens = meta["train_tokens"] + meta["val_tokens"]
    print(f"jaxmp: prepared {args.out}: {len(meta['sources'])} file(s), "
          f"{fmt_bytes(meta['bytes'])} → {meta['train_tokens']:,} train + {meta['val_tokens']:,} "
          f"val tokens ({meta['tokenizer']}, vocab {meta['vocab_size']}, {meta['dtype']}) in "
          f"{fmt_time(meta['seconds'])}, {tokens / max(meta['seconds'], 1e-9):,.0f} tokens/s",
          file=sys.stderr)
    return 0
