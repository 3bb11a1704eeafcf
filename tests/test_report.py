"""`jaxmp report` on a real short run, and the progress display `jaxmp train` shows."""
from __future__ import annotations

import io
import json
import shutil

import jax
import pytest

from jaxmp.cli import main
from jaxmp.recipes.gpt import gpt_trainer
from jaxmp.recipes.gpt_config import load_config
from jaxmp.train.metrics import Progress

SHORT = ["model.layers=1", "model.d_model=32", "model.heads=2", "train.batch_size=4",
         "data.seq_len=16", "train.steps=6", "logging.every=2", "train.eval_every=3",
         "train.eval_batches=1", "checkpoint.enabled=false", "logging.progress=false",
         "logging.tensorboard=false", "mesh.data=1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    gpt_trainer(load_config(None, SHORT), run, devices=jax.devices()[:1]).fit()
    return run


def test_report_draws_the_run(run_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="jaxmp report needs matplotlib "
                                             "(pip install 'jaxmp[report]'; the test extra has it)")
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)  # a second run to overlay
    with open(other / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "loss": 1.5')  # torn by a kill: skipped
    out = tmp_path / "report"
    assert main(["report", str(run_dir), str(other), "--out", str(out)]) == 0
    for name in ("loss.png", "tokens_per_s.png", "mfu.png", "grad_norm.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    md = (out / "report.md").read_text()
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert f"{last['loss']:.4f}" in md and f"{last['eval_loss']:.4f}" in md
    assert "](loss.png)" in md and "1 layers × d_model 32" in md and "other" in md
    assert "wrote" in capsys.readouterr().out


def test_report_default_out_and_bad_dirs(run_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="jaxmp report needs matplotlib")
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report" / "loss.png").is_file()
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl" in err[0]


def test_report_without_matplotlib_names_the_extra(run_dir, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    assert main(["report", str(run_dir), "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "jaxmp[report]" in err[0]
    assert not (tmp_path / "r").exists()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drive(stream) -> str:
    p = Progress(200, stream=stream)
    p.message("jaxmp: mesh data=1 [starting]")
    for step in (10, 20, 30):
        p.update(step, 5.0 - step / 100, 12345.0)
    p.message("a note")
    p.update(200, 2.0, 23456.0)
    p.close()
    return stream.getvalue()


def test_progress_is_plain_lines_without_a_terminal():
    text = _drive(io.StringIO())
    lines = text.splitlines()
    assert lines[0] == "jaxmp: mesh data=1 [starting]" and "a note" in lines
    steps = [x for x in lines if x.startswith("step")]
    assert len(steps) == 4 and "\x1b" not in text and "\r" not in text
    assert steps[0].startswith("step  10/200  loss  4.9000") and "12,345 tok/s" in steps[0]
    assert "elapsed 0:00" in steps[0] and "ETA --:--" in steps[0]
    assert "ETA 0:" in steps[1]  # an estimate once there is a rate


def test_progress_redraws_in_place_on_a_terminal():
    text = _drive(_Terminal())
    assert "\r" in text and "\x1b[" in text  # the line is rewritten, not appended
    assert text.count("\n") <= 4  # the two messages and the final bar, not one per update
    assert "step 200/200" in text and "23,456 tok/s" in text and "a note" in text
