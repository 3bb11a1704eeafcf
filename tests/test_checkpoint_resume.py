"""Trainer resume: preempted-and-resumed runs end bitwise equal to uninterrupted ones.

In-process: the "preemption" is a real SIGTERM the process sends itself while the data
iterator produces a chosen batch, so the step it lands on is deterministic. A separate file
(test_checkpoint_process.py) stops a real ``jaxmp train`` process from outside.
"""
from __future__ import annotations

import shutil
import signal

import jax
import pytest

import jaxmp
from jaxmp.checkpoint import CheckpointError, digest, list_steps, restore
from jaxmp.models import lm_loss
from jaxmp.recipes.gpt import lm_batches
from jaxmp.train.loop import Trainer
from helpers import Recorder
from test_checkpoint_helpers import TINY_GPT, Bigram

STEPS = 8
TINY = TINY_GPT + [f"train.steps={STEPS}", "checkpoint.every=3", "checkpoint.keep=3"]
MESH8 = ["mesh.fsdp=2", "mesh.tensor=4"]


def _trainer(run_dir, extra=(), devices=None, signal_at=None, sig=signal.SIGTERM, d=32):
    config = jaxmp.load_config(None, overrides=TINY + list(extra))
    data = Recorder(lm_batches(config), signal_at, sig)
    return Trainer(config, lambda rngs: Bigram(256, d, rngs), lm_loss, data, run_dir=run_dir,
                   devices=devices, model_flops_per_token=1.0)  # no second compile for MFU


def _state_digest(trainer) -> dict[str, str]:
    return digest(trainer.state)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 8-step run on fsdp2 x tensor4: its final state digest and run dir."""
    run = tmp_path_factory.mktemp("ref")
    trainer = _trainer(run, MESH8)
    trainer.fit()
    assert trainer.data.read == list(range(STEPS))
    return _state_digest(trainer), run


def test_sigterm_then_resume_is_bitwise_identical(reference, tmp_path):
    ref_digest, _ = reference
    first = _trainer(tmp_path, MESH8, signal_at=4)  # SIGTERM while reading batch 4
    before = signal.getsignal(signal.SIGTERM)
    final = first.fit()
    assert int(first.state.step) == 5 and final["step"] == 5  # step 4 finished, then stopped
    assert [s.step for s in list_steps(tmp_path) if s.complete] == [3, 5]
    assert signal.getsignal(signal.SIGTERM) is before  # handlers given back

    second = _trainer(tmp_path, MESH8)
    second.fit()
    assert second.data.read == [5, 6, 7]  # the stream continues: nothing repeated or skipped
    got = _state_digest(second)
    assert got == ref_digest  # params, optimizer state, step: every bit
    assert [s.step for s in list_steps(tmp_path) if s.complete] == [5, 6, 8]  # keep=3


def test_sigint_also_saves_at_the_step_boundary(tmp_path):
    trainer = _trainer(tmp_path, MESH8 + ["train.steps=3", "checkpoint.every=0"], signal_at=1,
                       sig=signal.SIGINT)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when started in the background
    trainer.fit()
    assert [s.step for s in list_steps(tmp_path)] == [2]
    assert signal.getsignal(signal.SIGINT) is before


def test_damaged_latest_falls_back_and_retrains_to_the_same_bits(reference, tmp_path, capfd):
    ref_digest, ref_run = reference
    shutil.copytree(ref_run / "checkpoints", tmp_path / "checkpoints")
    data_files = sorted((tmp_path / "checkpoints" / "8" / "state").rglob("d/*"))
    assert data_files
    for f in data_files:  # truncate the array data of the latest step
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    trainer = _trainer(tmp_path, MESH8)
    trainer.fit()
    err = capfd.readouterr().err
    assert "checkpoint" in err and "falling back to step 6" in err
    assert trainer.data.read == [6, 7]
    assert _state_digest(trainer) == ref_digest
    names = {p.name for p in (tmp_path / "checkpoints").iterdir()}
    assert "8.damaged" in names and "8" in names  # set aside, then saved again


def test_resume_on_fewer_devices_continues_the_stream(reference, tmp_path):
    _, ref_run = reference
    shutil.copytree(ref_run / "checkpoints", tmp_path / "checkpoints")
    shutil.rmtree(tmp_path / "checkpoints" / "8")  # resume from step 6, on 2 devices
    trainer = _trainer(tmp_path, ["mesh.fsdp=2", "mesh.tensor=1"], devices=jax.devices()[:2])
    trainer.fit()
    assert trainer.mesh.size == 2
    assert trainer.data.read == [6, 7]
    params = restore(tmp_path, mesh=jaxmp.make_mesh({"fsdp": 2}, jax.devices()[:2]))
    assert params["embed"].shape == (256, 32) and params["embed"].sharding.mesh.size == 2


def test_checkpoint_that_does_not_fit_the_model_is_one_clear_error(reference):
    _, ref_run = reference
    trainer = _trainer(ref_run, MESH8, d=64)
    with pytest.raises(CheckpointError, match=r"does not fit the configured model: params/embed "
                                              r"has shape \[256, 32\] in the checkpoint but "
                                              r"\[256, 64\] in the model"):
        trainer.fit()
