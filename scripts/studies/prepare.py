"""How long `jaxmp data prepare` takes on a 100 MB corpus, and how much memory it holds.

    python scripts/measure.py prepare --mb 10,100 --bpe 8192 --repeats 2 \
        --dir /tmp/jaxmp-bench-prepare

The corpus is this Python's standard-library sources (the UTF-8 ones) concatenated again and
again into 8 MiB files until it reaches each ``--mb`` size: real text, no download. For each
size, each round runs three preparations, interleaved A B C A B C, each one a fresh
``python -m jaxmp.cli data prepare`` process timed by wall clock with its peak RSS from
``wait4``:

- ``bytes``: ids are the bytes (no tokenizer work: reading, hashing, writing);
- ``bpe:N``: train a byte-level BPE of N tokens on the train part, then encode everything;
- ``tokenizer.json``: encode only, with the tokenizer the first ``bpe:N`` run trained.

Prints a Markdown table: median seconds of the preparation itself (``meta.json``'s
``seconds``; min–max over rounds), the process's wall time (adds Python start-up and imports),
tokens, tokens/s, MB/s of input, peak RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from jaxmp.errors import Failure

DOC = "docs/benchmarks.md"
DEVICES = False  # no devices: `jaxmp data prepare` runs on the host
PART = 8 * 2**20


def stdlib_texts() -> list[bytes]:
    root, out = sysconfig.get_paths()["stdlib"], []
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d != "site-packages")
        for name in sorted(files):
            if name.endswith(".py"):
                body = Path(folder, name).read_bytes()
                try:
                    body.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                out.append(body)
    return out


def make_corpus(folder: Path, mb: int) -> int:
    """``mb`` MB (10^6 bytes) of stdlib text in PART-sized files; reused if already there."""
    target = mb * 10**6
    if folder.is_dir() and sum(p.stat().st_size for p in folder.iterdir()) >= target:
        return sum(p.stat().st_size for p in folder.iterdir())
    folder.mkdir(parents=True, exist_ok=True)
    texts, written, part, buf = stdlib_texts(), 0, 0, []
    while written < target:
        for body in texts:
            buf.append(body)
            written += len(body)
            if sum(map(len, buf)) >= PART or written >= target:
                (folder / f"part{part:03d}.txt").write_bytes(b"".join(buf))
                part, buf = part + 1, []
            if written >= target:
                break
    return written


def prepare(corpus: Path, out: Path, tokenizer: str) -> dict:
    cmd = [sys.executable, "-m", "jaxmp.cli", "data", "prepare", str(corpus), "--out", str(out),
           "--tokenizer", tokenizer, "--json"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise Failure(f"{' '.join(cmd)} failed: {stderr}")
    meta = json.loads(stdout)
    return {"seconds": meta["seconds"], "wall": seconds,
            "tokens": meta["train_tokens"] + meta["val_tokens"],
            "bytes": meta["bytes"], "rss": usage.ru_maxrss * 1024, "vocab": meta["vocab_size"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", default="100", help="corpus sizes in MB, comma-separated")
    p.add_argument("--bpe", type=int, default=8192, help="BPE vocabulary size")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default="/tmp/jaxmp-bench-prepare")


def run(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    print(f"# python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start")
    print("| corpus | tokenizer | seconds (median, min–max) | process wall s | tokens | "
          "tokens/s | MB/s | peak RSS |\n|---|---|---:|---:|---:|---:|---:|---:|")
    for mb in (int(x) for x in args.mb.split(",")):
        corpus = root / f"corpus-{mb}mb"
        size = make_corpus(corpus, mb)
        trained = root / f"out-{mb}-bpe" / "tokenizer.json"
        variants = {"bytes": "bytes", f"bpe:{args.bpe}": f"bpe:{args.bpe}",
                    "tokenizer.json (encode only)": str(trained)}
        results: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(args.repeats):
            for name, spec in variants.items():
                out = root / f"out-{mb}-{'bpe' if name.startswith('bpe') else name.split()[0]}"
                results[name].append(prepare(corpus, out, spec))
        for name, rs in results.items():
            secs = [r["seconds"] for r in rs]
            med, r0 = statistics.median(secs), rs[0]
            wall = statistics.median(r["wall"] for r in rs)
            print(f"| {size / 1e6:.1f} MB | {name} | {med:.3g} ({min(secs):.3g}–{max(secs):.3g})"
                  f" | {wall:.1f} | {r0['tokens']:,} | {r0['tokens'] / med:,.0f} | "
                  f"{size / 1e6 / med:.1f} | "
                  f"{max(r['rss'] for r in rs) / 2**20:.0f} MiB |", flush=True)
    return 0

