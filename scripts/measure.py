"""Every measured number in docs/ comes from one study here, run with one command.

    python scripts/measure.py                          # the studies and the doc each one feeds
    python scripts/measure.py STUDY --help             # a study's options
    python scripts/measure.py comm --simulate-devices 8

A study measures what the product does — the step `jaxmp train` runs, the planner `jaxmp plan`
runs, the bench `jaxmp bench` runs — and prints the tables (or writes the charts) of its doc;
the doc quotes the command beside each table. Studies that use devices take the flags every
`jaxmp` command takes: ``--devices N`` uses the first N devices present (default: all), and
``--simulate-devices N`` gives the CPU backend N devices before jax starts. Each study is a
module of scripts/studies/ with ``add_arguments(parser)`` and ``run(args)``.

Not here: scripts/chaos.py and scripts/bench_rss.py (reliability checks that pass or fail),
scripts/launch_local.sh (several local processes), scripts/gpu_check.sh (one GPU, end to end),
scripts/docs.py (the generated references).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from jaxmp._util.env import settle_platform
from jaxmp.cli.train import add_device_arguments, simulate
from jaxmp.errors import BadInput, Failure

# study name -> module of scripts/studies/ (each says which doc it feeds in DOC)
STUDIES = {
    "comm": "comm",
    "compression": "compression",
    "compression-curves": "compression_curves",
    "planner-accuracy": "planner_accuracy",
    "published": "published",
    "device-efficiency": "device_efficiency",
    "strategies": "strategies",
    "pipeline": "pipeline",
    "deviceless-attention": "deviceless_attention",
    "deviceless-scale": "deviceless_scale",
    "optimizer-sharding": "optimizer_sharding",
    "master-weights": "master_weights",
    "sum-in-backward": "sum_in_backward",
    "sequence-parallel": "sequence_parallel",
    "overhead": "overhead",
    "checkpoint": "checkpoint",
    "prepare": "prepare",
    "hf-import": "hf_import",
}


def study(name: str):
    return importlib.import_module(f"studies.{STUDIES[name]}")


def listing() -> str:
    lines = [__doc__.split("\n\n")[0], "", "studies:"]
    for name in STUDIES:
        module = study(name)
        lines.append(f"  {name:21} {module.__doc__.splitlines()[0]}")
        lines.append(f"  {'':21} -> {module.DOC}")
    lines += ["", "python scripts/measure.py STUDY --help for its options"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    if argv[0] not in STUDIES:
        print(f"measure: error: unknown study {argv[0]!r} (studies: {', '.join(STUDIES)})",
              file=sys.stderr)
        return 2
    name, module = argv[0], study(argv[0])
    p = argparse.ArgumentParser(prog=f"measure.py {name}", description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if module.DEVICES:
        add_device_arguments(p, "to measure on: the first N present")
    module.add_arguments(p)
    args = p.parse_args(argv[1:])
    settle_platform()  # as jaxmp's CLI: the CPU, quietly, where the CUDA plugin finds no GPU
    try:
        if module.DEVICES:
            simulate(args.simulate_devices)  # before jax starts its backend
        return module.run(args) or 0
    except BadInput as e:
        print(f"measure: error: {e}", file=sys.stderr)
        return 2
    except Failure as e:
        print(f"measure: {name} failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
