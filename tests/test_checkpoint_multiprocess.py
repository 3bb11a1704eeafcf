"""2 processes x 4 CPU devices (gloo): they restore a 1 x 8 checkpoint and save their own, which
1 process x 8 devices restores, with identical values both ways; and a SIGTERM sent to one of
them stops both at the same step with a checkpoint."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp
from jaxmp import checkpoint
from jaxmp.checkpoint import inspect_report
from test_checkpoint_helpers import REPO, free_port, subprocess_env

PATH_RULES = [(r"embed$", ("vocab", "embed")), (r"out$", ("embed", "vocab")),
              (r"norm$", ("norm",))]

WORKER = """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, src, dst, out = sys.argv[1:]
jax.distributed.initialize(f"127.0.0.1:{port}", 2, int(pid))
import jaxmp
from jaxmp import checkpoint
assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
mesh = jaxmp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})  # spans both processes
state = checkpoint.restore(src, mesh=mesh, what="state")
assert not state["params"]["embed"].is_fully_addressable
digest = checkpoint.digest(state)
checkpoint.save(dst, 5, state, names=checkpoint.logical_names(src))
if pid == "0":
    with open(out, "w") as f:
        json.dump({"digest": digest, "spec": str(state["params"]["embed"].sharding.spec)}, f)
"""


def _state():
    mesh = jaxmp.make_mesh({"fsdp": 2, "tensor": 4})
    key = iter(jax.random.split(jax.random.key(0), 8))

    def rand(shape, spec):
        return jax.jit(lambda k: jax.random.normal(k, shape),
                       out_shardings=NamedSharding(mesh, spec))(next(key))

    return {"step": jnp.int32(5),
            "params": {"embed": rand((256, 64), P("tensor", "fsdp")),
                       "out": rand((64, 256), P("fsdp", "tensor")),
                       "norm": rand((64,), P("fsdp"))},
            "opt_state": {"mu": {"embed": rand((256, 64), P("tensor", "fsdp"))}}}


def test_two_processes_restore_and_save_one_process_restores(tmp_path):
    state = _state()
    want = checkpoint.digest(state)
    src, dst, out = tmp_path / "one_by_eight", tmp_path / "two_by_four", tmp_path / "out.json"
    checkpoint.save(src, 5, state, path_rules=PATH_RULES)

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(i), str(src),
                               str(dst), str(out)], cwd=REPO, env=subprocess_env(4),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]

    result = json.loads(out.read_text())
    assert result["digest"] == want  # 1 x 8 -> 2 x 4: identical values
    assert result["spec"] == str(P("tensor", "fsdp"))  # names re-resolved on the new mesh

    meta = checkpoint.info(dst)["meta"]
    assert meta["processes"] == 2 and meta["mesh"] == {"data": 2, "stage": 1, "fsdp": 2,
                                                       "tensor": 2}
    back = checkpoint.restore(dst, mesh=jaxmp.make_mesh({"data": 8}), what="state")
    assert checkpoint.digest(back) == want  # 2 x 4 -> 1 x 8: identical values
    report = inspect_report(dst, with_digest=True)  # what `jaxmp ckpt inspect --digest` prints
    assert {p: a["sha256"] for p, a in report["arrays"].items()} == want


PREEMPTED = """
import sys, time
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, run = sys.argv[1:]
jax.distributed.initialize(f"127.0.0.1:{port}", 2, int(pid))
import jaxmp
from jaxmp.models import lm_loss
from jaxmp.recipes.gpt import lm_batches
from jaxmp.train.loop import Trainer
from test_checkpoint_helpers import TINY_GPT, Bigram

config = jaxmp.load_config(None, TINY_GPT + [
    "train.steps=5000", "checkpoint.every=1000", "logging.every=10",
    "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])

class Paced:  # a few ms per batch, so the run is still going when the notice comes
    def __init__(self, it):
        self.it = it
    def __iter__(self):
        return self
    def __next__(self):
        time.sleep(0.004)
        return next(self.it)
    def get_state(self):
        return self.it.get_state()
    def set_state(self, state):
        self.it.set_state(state)

trainer = Trainer(config, lambda rngs: Bigram(256, 32, rngs), lm_loss, Paced(lm_batches(config)),
                  run_dir=run, model_flops_per_token=1.0)
trainer.fit()
print("STOPPED AT", int(trainer.state.step), flush=True)
"""


def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(tmp_path):
    port, run = free_port(), tmp_path / "run"
    env = subprocess_env(4)
    env["PYTHONPATH"] += os.pathsep + str(REPO / "tests")
    procs = [subprocess.Popen([sys.executable, "-c", PREEMPTED, str(port), str(i), str(run)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    deadline = time.time() + 240
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert time.time() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)  # only one host gets the notice
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    stopped = {int(line.split()[-1]) for log in logs for line in log.splitlines()
               if line.startswith("STOPPED AT")}
    assert len(stopped) == 1  # JAX's preemption sync point: both hosts agree on the step
    step = stopped.pop()
    assert 20 <= step < 5000
    assert [s.step for s in checkpoint.list_steps(run) if s.complete][-1] == step
    assert checkpoint.info(run)["data"]["step"] == step
