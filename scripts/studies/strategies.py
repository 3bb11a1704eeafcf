"""Strategies side by side: `jaxmp bench` of the default model and of one ten times its size.

    python scripts/measure.py strategies --simulate-devices 8                 # ~5 min on 2 cores
    python scripts/measure.py strategies --simulate-devices 8 --only default  # one of them

Regenerates the measured tables of docs/strategies.md. Each model's bench.md, bench.json and
charts go to docs/strategies/<name>/; the text between ``<!-- bench:<name> -->`` and
``<!-- /bench:<name> -->`` in docs/strategies.md is replaced by
that bench.md (its tables and charts), everything else in the doc is left as written.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

from studies.common import ROOT

DOC = "docs/strategies.md"
DEVICES = True  # passed on to `jaxmp bench`
OUT = ROOT / "docs" / "strategies"
STRATEGIES = "dp,fsdp,tensor,fsdp+tensor,dp+fsdp,stage,auto"
MODELS = {
    # configs/tiny.toml as it is: 4 layers x d_model 128, 0.82 M parameters, batch 16 x 128.
    "default": [],
    # 10 layers x d_model 256 (8 heads): 7.93 M parameters, 9.7x the default; same batch.
    "10x": ["model.layers=10", "model.d_model=256", "model.heads=8"],
}


def bench(name: str, args: argparse.Namespace) -> str:
    """`jaxmp bench` of one model, as a user runs it; its bench.md."""
    out = OUT / name
    sets = [x for s in MODELS[name] for x in ("--set", s)]
    devices = [x for flag, n in (("--devices", args.devices),
                                 ("--simulate-devices", args.simulate_devices))
               if n is not None for x in (flag, str(n))]
    cmd = [sys.executable, "-m", "jaxmp.cli", "bench", *devices, "--strategies", STRATEGIES,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out), *sets]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return (out / "bench.md").read_text()


def splice(doc: str, name: str, md: str, where: str) -> str:
    """Put ``md`` (its headings one level down, image links relative to the doc) between the
    markers for ``name``."""
    body = md.split("\n", 1)[1].strip()  # drop the "# jaxmp bench" title
    body = re.sub(r"^(#+) ", r"#\1 ", body, flags=re.M)
    body = re.sub(r"\]\((\w+\.png)\)", rf"]({where}/\1)", body)
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    if start not in doc or end not in doc:
        raise SystemExit(f"{DOC}: markers {start} ... {end} not found")
    head, rest = doc.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", choices=sorted(MODELS), default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)


def run(args: argparse.Namespace) -> int:
    path = ROOT / DOC
    doc = path.read_text()
    for name in [args.only] if args.only else list(MODELS):
        doc = splice(doc, name, bench(name, args), f"strategies/{name}")
    path.write_text(doc)
    print(f"updated {DOC}")
    return 0
