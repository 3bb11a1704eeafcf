"""Regenerate the measured tables of docs/strategies.md: `jaxmp bench` on 8 simulated CPU devices
for the default model and for a model about ten times its parameter count.

    python scripts/strategies_doc.py                  # both models (~5 minutes on 2 cores)
    python scripts/strategies_doc.py --only default   # one of them

Each model's bench.md, bench.json and charts go to docs/strategies/<name>/; the text between
``<!-- bench:<name> -->`` and ``<!-- /bench:<name> -->`` in docs/strategies.md is replaced by
that bench.md (its tables and charts), everything else in the doc is left as written.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "strategies.md"
OUT = ROOT / "docs" / "strategies"
STRATEGIES = "dp,fsdp,tensor,fsdp+tensor,dp+fsdp,stage,auto"
MODELS = {
    # configs/tiny.toml as it is: 4 layers x d_model 128, 0.82 M parameters, batch 16 x 128.
    "default": [],
    # 10 layers x d_model 256 (8 heads): 7.93 M parameters, 9.7x the default; same batch.
    "10x": ["model.layers=10", "model.d_model=256", "model.heads=8"],
}


def bench(name: str, steps: int, warmup: int) -> Path:
    out = OUT / name
    sets = [x for s in MODELS[name] for x in ("--set", s)]
    cmd = [sys.executable, "-m", "jaxmp.cli", "bench", "--simulate-devices", "8", "--strategies",
           STRATEGIES, "--steps", str(steps), "--warmup", str(warmup), "--out", str(out), *sets]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return out / "bench.md"


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=sorted(MODELS), default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    doc = DOC.read_text()
    for name in [args.only] if args.only else list(MODELS):
        md = bench(name, args.steps, args.warmup).read_text()
        doc = splice(doc, name, md, f"strategies/{name}")
    DOC.write_text(doc)
    print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
