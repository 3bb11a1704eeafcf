"""``jaxmp sample RUN_DIR [--step N] [--prompt TEXT] [--tokens N] [--temperature T] ...``.

Argument parsing only; the work is in :mod:`jaxmp.recipes.sample`.
"""

from __future__ import annotations

import argparse
from typing import Any

from jaxmp.cli.train import simulate


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sample", help="generate text from a run's checkpoint",
                              description="Restore a run's checkpoint on the devices present and "
                                          "print samples (KV-cached decoding in one jitted loop).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or its checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="default: latest complete step")
    p.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    p.add_argument("--tokens", type=int, default=200, help="new tokens per sample (%(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0 = greedy, deterministic (%(default)s)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest only")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (%(default)s)")
    p.add_argument("--num-samples", type=int, default=1, help="samples to print (%(default)s)")
    p.add_argument("--simulate-devices", type=int, default=None, metavar="N",
                   help="restore onto N simulated CPU devices")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    simulate(args.simulate_devices)
    from jaxmp.cli.ckpt import _quiet_orbax
    from jaxmp.recipes.sample import Sampler

    _quiet_orbax()
    sampler = Sampler.load(args.run_dir, args.step)
    texts = sampler.sample(args.prompt, tokens=args.tokens, temperature=args.temperature,
                           top_k=args.top_k, seed=args.seed, num_samples=args.num_samples)
    for i, text in enumerate(texts):
        if i:
            print("-" * 40)
        print(text)
    return 0
