#!/usr/bin/env python
"""Does a long run's host memory grow? RSS of `jaxmp train` sampled over thousands of steps.

    python scripts/bench_rss.py                       # the tiny config, 2,000 steps
    python scripts/bench_rss.py --steps 300 --json    # a short look

Runs ``jaxmp train`` (the built-in tiny config: checkpoints every 100 steps, evaluation every
100, metrics every 10, TensorBoard on) as a child process and reads its resident set size from
``/proc/<pid>/status`` twice a second, next to the step it has reached (the last line of
metrics.jsonl). After warm-up (the first ``--warmup`` steps: compiles, the first saves and
evaluations, allocator pools filling) the RSS must stay within ``--limit`` (5 %) of its value at
the end of warm-up. Prints the RSS every ``--every`` steps — total, anonymous (the process's own
memory) and file-backed (pages of mapped files such as the token file, which fill in as training
reads further into it) — the growth, and a linear fit (MiB per 1,000 steps). Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


FIELDS = ("VmRSS", "RssAnon", "RssFile")  # total = anonymous (heap) + file-backed (+ shmem)


def rss_bytes(pid: int) -> dict[str, int] | None:
    """Resident bytes: total, anonymous (the process's own memory) and file-backed (pages of
    mapped files: the token file, shared libraries — reclaimable page cache)."""
    try:
        found = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in FIELDS:
                found[key] = int(line.split()[1]) * 1024
        return found if len(found) == len(FIELDS) else None
    except (FileNotFoundError, ProcessLookupError):
        return None


def last_step(metrics: Path) -> int:
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            lines = f.read().decode(errors="replace").splitlines()
        for line in reversed(lines):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError):
                continue
    except FileNotFoundError:
        pass
    return 0


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares bytes per step."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200, help="steps before the baseline")
    p.add_argument("--limit", type=float, default=0.05, help="allowed growth (default 5 %%)")
    p.add_argument("--every", type=int, default=100, help="print the RSS every N steps")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--run-dir", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="jaxmp-rss-")) / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH")) if x)
    cmd = [sys.executable, "-m", "jaxmp.cli", "train", "--run-dir", str(run_dir),
           "--set", f"train.steps={args.steps}", "--set", "logging.progress=false",
           *[a for kv in args.set for a in ("--set", kv)]]
    start = time.monotonic()
    child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    samples: list[tuple[float, int, dict[str, int]]] = []  # (seconds, step, rss by kind)
    while child.poll() is None:
        rss = rss_bytes(child.pid)
        if rss:
            samples.append((time.monotonic() - start, last_step(run_dir / "metrics.jsonl"), rss))
        time.sleep(0.5)
    err = child.stderr.read()
    if child.returncode:
        print(f"bench_rss: jaxmp train failed ({child.returncode}):\n{err[-2000:]}", file=sys.stderr)
        return 1
    report = {"steps": args.steps, "warmup_steps": args.warmup,
              "seconds": round(time.monotonic() - start), "samples": len(samples),
              "limit": args.limit, "run_dir": str(run_dir)}
    for field in FIELDS:
        stats = _growth([(s, r[field]) for _, s, r in samples], args)
        if stats is None:
            print("bench_rss: no samples after warm-up", file=sys.stderr)
            return 1
        report[field] = stats
    report["passed"] = report["VmRSS"]["growth_peak"] <= args.limit
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["passed"] else 1
    print(f"bench_rss: {args.steps} steps in {report['seconds']} s, {len(samples)} samples; "
          f"run dir {run_dir}")
    print("   step   " + "".join(f"{f:>10}" for f in FIELDS) + "   (MiB, max in the window)")
    for k in report["VmRSS"]["by_step_mib"]:
        print(f"  {k:>5}   " + "".join(f"{report[f]['by_step_mib'][k]:10.1f}" for f in FIELDS))
    for field in FIELDS:
        r = report[field]
        print(f"  {field}: after warm-up ({args.warmup} steps) {r['baseline_mib']:.1f} MiB, "
              f"peak {r['peak_mib']:.1f} MiB ({100 * r['growth_peak']:+.2f} %), trend "
              f"{r['mib_per_1000_steps']:+.2f} MiB / 1000 steps")
    print(f"  {'PASS' if report['passed'] else 'FAIL'}: total RSS peak within "
          f"{100 * args.limit:.0f} % of the baseline")
    return 0 if report["passed"] else 1


def _growth(points: list[tuple[int, int]], args: argparse.Namespace) -> dict | None:
    """Baseline (median of the first window after warm-up), peak and trend after warm-up.

    The last samples (the process tearing down after its final step) are left out.
    """
    after = [(s, r) for s, r in points if args.warmup <= s < args.steps]
    if not after:
        return None
    base = statistics.median(r for s, r in after if s < args.warmup + args.every)
    peak = max(r for _, r in after)
    by_step: dict[int, list[int]] = {}
    for s, r in points:
        if s < args.steps:
            by_step.setdefault(s // args.every * args.every, []).append(r)
    return {"baseline_mib": base / 2**20, "peak_mib": peak / 2**20,
            "growth_peak": peak / base - 1, "mib_per_1000_steps": slope(after) * 1000 / 2**20,
            "by_step_mib": {k: round(max(v) / 2**20, 1) for k, v in sorted(by_step.items())}}


if __name__ == "__main__":
    sys.exit(main())
