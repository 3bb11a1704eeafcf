"""Host memory and throughput of `jaxmp ckpt import` / `export --format llama` at >= 1 GB.

The checkpoint is a random Llama-shaped one, imported onto the devices asked for.

    python scripts/measure.py hf-import --gb 1 --simulate-devices 8 --dir /tmp/jaxmp-hf-bench

1. Writes a random ``LlamaForCausalLM`` folder of about ``--gb`` GB (bf16, d_model 2048,
   grouped-query attention, untied head; the layer count sets the size), streamed one tensor at
   a time, and evicts it from the page cache.
2. In a fresh child process per phase (the devices asked for, one ``fsdp`` axis):
   jax started and the mesh built, then the baseline RSS taken and the peak reset
   (``/proc/self/clear_refs``), then
   - ``place``: every param built on the mesh from the HF tensors and dropped when built (what
     the host goes through when the devices are accelerators, whose memory is not host RSS);
   - ``import``: the whole ``jaxmp ckpt import`` (params kept on the devices, then saved);
   - ``export``: ``jaxmp ckpt export --format llama`` of that run;
   and the peak RSS (``VmHWM``) over the baseline, per param and for the save, minus what the
   devices held at that moment (on simulated CPU devices the devices' memory *is* host
   memory), compared with the largest tensor.

Goal (issue 22): peak ≤ baseline + 2 × the largest tensor for the host's own work.
``--param-dtype`` runs the phases importing into bfloat16 (the tensors as stored) and into
float32 (the import's default: master weights for fine-tuning). MB/s counts the checkpoint's
bytes (export: the bytes written). Linux only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from jaxmp.errors import Failure
from studies.common import ROOT, devices, evict

DOC = "docs/huggingface.md"
DEVICES = True
MIB = 2**20


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def llama_shapes(gb: float, d: int = 2048, heads: int = 16, kv: int = 4, mlp: int = 5632,
                 vocab: int = 32000) -> tuple[dict, dict]:
    """(config.json, {name: shape}) of a Llama with enough layers for ``gb`` GB in bf16."""
    hd = d // heads
    per_layer = d * hd * (2 * heads + 2 * kv) + 3 * d * mlp + 2 * d
    layers = max(1, math.ceil((gb * 1e9 / 2 - 2 * vocab * d - d) / per_layer))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": d, "intermediate_size": mlp, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False, "max_position_embeddings": 8192,
              "torch_dtype": "bfloat16"}
    shapes = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "self_attn.q_proj.weight": (d, d),
                   p + "self_attn.k_proj.weight": (kv * hd, d),
                   p + "self_attn.v_proj.weight": (kv * hd, d),
                   p + "self_attn.o_proj.weight": (d, d),
                   p + "post_attention_layernorm.weight": (d,),
                   p + "mlp.gate_proj.weight": (mlp, d), p + "mlp.up_proj.weight": (mlp, d),
                   p + "mlp.down_proj.weight": (d, mlp)}
    shapes |= {"model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    return config, shapes


def write_checkpoint(folder: Path, gb: float) -> dict:
    import ml_dtypes
    import numpy as np

    from jaxmp.checkpoint.inspect import write_safetensors

    config, shapes = llama_shapes(gb)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)

    def tensors():
        for shape in shapes.values():
            yield (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)

    start = time.perf_counter()
    size = write_safetensors(folder / "model.safetensors",
                             [(n, "bfloat16", s) for n, s in shapes.items()], tensors(),
                             {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    evict(folder)
    largest = max(math.prod(s) for s in shapes.values()) * 2
    return {"bytes": size, "largest_tensor_bytes": largest, "tensors": len(shapes),
            "layers": config["num_hidden_layers"], "write_s": time.perf_counter() - start}


def measured(place, baseline: int, out: dict, keep: bool):
    """``place`` that notes, after each param, the peak since the previous one minus what the
    devices held then (the arrays built so far if ``keep``, else only this one): the host's
    own share of the peak; and resets the peak."""
    def wrapped(*args, **kwargs):
        held = 0
        for path, array, sums in place(*args, **kwargs):
            array.block_until_ready()
            held = held + array.nbytes if keep else array.nbytes
            out["host"] = max(out.get("host", 0), status("VmHWM") - baseline - held)
            out["on_devices"] = max(out.get("on_devices", 0), held)
            yield path, array, sums
            del array
            Path("/proc/self/clear_refs").write_text("5")  # once the caller dropped it
    return wrapped


def child(phase: str, dtype: str, folder: Path, work: Path, devs: list) -> dict:
    """One phase in this (fresh) process; returns its measurements."""
    from jaxmp._util.env import return_large_frees

    return_large_frees()  # as `jaxmp ckpt import` / `export` do
    import jax

    import jaxmp
    import jaxmp.checkpoint.hf.load as load
    from jaxmp.checkpoint.hf import Weights
    from jaxmp.checkpoint.hf.export import export_hf
    from jaxmp.recipes.gpt import model_gpt_config
    from jaxmp.recipes.hf import hf_config, import_run

    mesh = jaxmp.make_mesh({"fsdp": -1}, devs)
    config = hf_config(folder, None, [f"model.param_dtype={dtype}"])
    jax.block_until_ready(jax.numpy.zeros(8))  # the backend started: part of the baseline
    baseline = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start, peak = time.perf_counter(), 0
    out: dict = {"phase": phase, "dtype": dtype, "baseline_rss": baseline,
                 "devices": len(devs)}
    if phase == "place":
        params = load.match(Weights(folder), load.gpt_params(model_gpt_config(config.model)),
                            str(folder))
        for item in measured(load.place, baseline, out, keep=False)(params, mesh):
            del item  # dropped before the next param is built
        out["bytes"] = sum(t.nbytes for p in params for t in p.tensors)
    elif phase == "import":
        load.place = measured(load.place, baseline, out, keep=True)
        summary = import_run(folder, work / f"run-{dtype}", config, mesh=mesh)
        out["bytes"] = summary["read_bytes"]
        # the save: every param on the devices, Orbax writing them
        out["host"] = max(out["host"], status("VmHWM") - baseline - summary["param_bytes"])
    else:
        summary = export_hf(work / f"run-{dtype}", work / f"export-{dtype}")
        out["bytes"] = summary["bytes"]
        out["host"] = status("VmHWM") - baseline
    out["seconds"] = time.perf_counter() - start
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (%(default)s)")
    p.add_argument("--dir", default="/tmp/jaxmp-hf-bench", help="work folder (removed after)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--param-dtype", default="bfloat16,float32",
                   help="model.param_dtype(s) to import into (%(default)s): bfloat16 keeps the "
                        "tensors as stored, float32 is the import's default")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    work = Path(args.dir)
    if args.child:
        phase, dtype = args.child.split(":")
        print(json.dumps(child(phase, dtype, work / "hf", work, devices(args))))
        return 0
    shutil.rmtree(work, ignore_errors=True)
    made = write_checkpoint(work / "hf", args.gb)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    given = [x for flag, n in (("--devices", args.devices),
                               ("--simulate-devices", args.simulate_devices))
             if n is not None for x in (flag, str(n))]
    results = []
    for dtype in args.param_dtype.split(","):
        for phase in ("place", "import", "export"):
            evict(work)
            r = subprocess.run([sys.executable, str(ROOT / "scripts" / "measure.py"), "hf-import",
                                *given, "--dir", str(work), "--child", f"{phase}:{dtype}"],
                               capture_output=True, text=True, env=env)
            if r.returncode:
                raise Failure(f"{phase} {dtype} failed:\n{r.stderr[-3000:]}")
            results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    shutil.rmtree(work, ignore_errors=True)
    largest = made["largest_tensor_bytes"]
    report = {"checkpoint": made, "phases": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"checkpoint: {made['bytes'] / 1e9:.2f} GB bf16, {made['layers']} layers, "
          f"{made['tensors']} tensors, largest {largest / MIB:.0f} MiB; "
          f"{results[0]['devices']} devices")
    print("host = the peak RSS over the baseline minus what the (simulated CPU) devices held "
          "at that moment, whose memory is host memory here: the one array being built "
          "(place), the arrays built so far and then the whole model while Orbax saves it "
          "(import)")
    print(f"{'phase':7} {'params':9} {'time s':>7} {'MB/s':>6} {'baseline MiB':>13} "
          f"{'max on devices':>15} {'host MiB':>9} {'host/largest':>13}")
    for r in results:
        print(f"{r['phase']:7} {r['dtype']:9} {r['seconds']:7.1f} "
              f"{r['bytes'] / 1e6 / r['seconds']:6.0f} {r['baseline_rss'] / MIB:13.0f} "
              f"{r.get('on_devices', 0) / MIB:15.0f} {r['host'] / MIB:9.0f} "
              f"{r['host'] / largest:13.2f}")
    return 0
