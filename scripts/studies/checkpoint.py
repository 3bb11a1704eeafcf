"""Checkpoint throughput vs the disk's own bandwidth, and how long a save blocks the loop.

    python scripts/measure.py checkpoint --gib 1 --simulate-devices 8 --dir /tmp/jaxmp-bench

1. Disk baseline, dd-like, in the same run and directory: write ``--gib`` GiB in 16 MiB chunks
   then ``fsync`` (the time includes the fsync); evict the file from the page cache with
   ``posix_fadvise(DONTNEED)`` and read it back (cold), then read again (warm).
2. A state of ``--gib`` GiB (float32 arrays sharded over the devices on one ``fsdp`` axis, with
   logical names) saved through the trainer's path (Orbax CheckpointManager, PyTree + JSON
   items) synchronously; its files evicted from the page cache; restored (cold) with
   ``jaxmp.checkpoint.restore`` onto the same mesh, then again (warm), and (cold) onto one
   device: one read and one host→device copy per array instead of one per shard.
   The synchronous save is timed to its commit, and again including an fsync of every file it
   wrote (the baseline's guarantee, whatever Orbax and TensorStore already flushed).
3. Loop blocking: wall time of the ``save()`` call with ``async_save`` on (returns after the
   device→host copy) vs off (returns after the files are committed), and the async save's total.

Caveats (see docs/benchmarks.md): the eviction only drops this kernel's clean pages of these
files (no root needed) — a virtual disk may still be cached by its host; on simulated CPU devices
"device→host" is a memcpy and every byte is copied by the same 2 cores that write it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from studies.common import devices, evict, fsync_all

DOC = "docs/benchmarks.md"
DEVICES = True
CHUNK = 16 * 2**20


def disk_baseline(folder: Path, nbytes: int) -> dict[str, float]:
    path = folder / "dd.bin"
    buf = os.urandom(CHUNK)
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(nbytes // CHUNK):
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    write = time.perf_counter() - t
    out = {"write_s": write}
    for label in ("read_cold_s", "read_warm_s"):
        if label == "read_cold_s":
            evict(path)
        view = bytearray(CHUNK)
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
        out[label] = time.perf_counter() - t
    path.unlink()
    return out


def make_state(nbytes: int, mesh):
    """``nbytes`` of float32 in 64 MiB arrays (plus a step), sharded by logical name."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    rows, cols = 4096, 4096  # 64 MiB each
    n = max(1, nbytes // (rows * cols * 4))
    shard = NamedSharding(mesh, PartitionSpec("fsdp"))
    make = jax.jit(lambda k: jax.random.normal(k, (rows, cols), jnp.float32), out_shardings=shard)
    keys = jax.random.split(jax.random.key(0), n)
    state = {"step": jnp.int32(1), "params": {f"w{i:02d}": make(keys[i]) for i in range(n)}}
    jax.block_until_ready(state)
    return state


def bench_checkpoint(folder: Path, state, mesh, repeats: int,
                     compress: bool) -> dict[str, list[float]]:
    import jax

    import jaxmp
    from jaxmp import checkpoint
    from jaxmp.checkpoint import records as tree
    from jaxmp.checkpoint import store

    path_rules = [(r"^params/w", ("embed", "mlp"))]
    items = tree.entries(state, path_rules)
    meta = store.make_meta(1, items)
    res: dict[str, list[float]] = {k: [] for k in (
        "save_sync_s", "save_fsync_s", "restore_cold_s", "restore_warm_s", "restore_1dev_cold_s",
        "async_block_s", "async_total_s")}
    one = jaxmp.make_mesh({}, jax.devices()[:1])  # same bytes, one piece per array
    for r in range(repeats):
        for async_save in (False, True):
            ckdir = folder / f"ckpt-{r}-{'async' if async_save else 'sync'}"
            manager = store.open_manager(ckdir, keep=1, async_save=async_save, compress=compress)
            t = time.perf_counter()
            manager.save(1, force=True, args=store.save_args(tree.to_pure(items), meta, None, None))
            blocked = time.perf_counter() - t
            manager.wait_until_finished()
            total = time.perf_counter() - t
            manager.close()
            if async_save:
                res["async_block_s"].append(blocked)
                res["async_total_s"].append(total)
                shutil.rmtree(ckdir)
                continue
            res["save_sync_s"].append(total)
            fsync_all(ckdir)  # whatever Orbax left to the OS to flush: compare like with dd
            res["save_fsync_s"].append(time.perf_counter() - t)
            for label, target in (("restore_cold_s", mesh), ("restore_warm_s", mesh),
                                  ("restore_1dev_cold_s", one)):
                if "cold" in label:
                    evict(ckdir)
                t = time.perf_counter()
                out = checkpoint.restore(ckdir, mesh=target, what="state")
                jax.block_until_ready(out)
                res[label].append(time.perf_counter() - t)
                del out
            shutil.rmtree(ckdir)
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--dir", default="/tmp/jaxmp-bench", help="where to write (same disk as runs)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--compress", action="store_true",
                   help="zstd-compress array chunks (Orbax's default; jaxmp's is off)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write results as JSON")


def run(args: argparse.Namespace) -> int:
    import jax

    import jaxmp

    devs = devices(args)
    folder = Path(args.dir)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    nbytes = int(args.gib * 2**30) // CHUNK * CHUNK
    mesh = jaxmp.make_mesh({"fsdp": -1}, devs)
    state = make_state(nbytes, mesh)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))

    disk = [disk_baseline(folder, state_bytes) for _ in range(args.repeats)]
    ckpt = bench_checkpoint(folder, state, mesh, args.repeats, args.compress)
    shutil.rmtree(folder, ignore_errors=True)

    best = {k: min(d[k] for d in disk) for k in disk[0]}
    best.update({k: min(v) for k, v in ckpt.items()})
    mib = state_bytes / 2**20
    rate = {k: mib / v for k, v in best.items() if k != "async_block_s"}
    result = {
        "state_mib": round(mib, 1), "devices": len(devs), "compress": args.compress,
        "platform": jax.devices()[0].platform, "cpus": os.cpu_count(), "repeats": args.repeats,
        "best_s": {k: round(v, 3) for k, v in best.items()},
        "all_s": {**{k: [round(d[k], 3) for d in disk] for k in disk[0]},
                  **{k: [round(x, 3) for x in v] for k, v in ckpt.items()}},
        "mib_per_s": {k: round(v, 1) for k, v in rate.items()},
        "save_vs_disk_write": round(rate["save_sync_s"] / rate["write_s"], 2),
        "save_fsync_vs_disk_write": round(rate["save_fsync_s"] / rate["write_s"], 2),
        "restore_vs_disk_read_cold": round(rate["restore_cold_s"] / rate["read_cold_s"], 2),
        "restore_vs_disk_read_warm": round(rate["restore_warm_s"] / rate["read_warm_s"], 2),
        "async_block_vs_sync": round(best["async_block_s"] / best["save_sync_s"], 3),
        "median_async_block_s": round(statistics.median(ckpt["async_block_s"]), 3),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0

