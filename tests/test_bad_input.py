"""The bad-input catalogue: each case through the real ``jaxmp`` CLI, one line naming the cause,
exit 2 (bad input) or 1 (runtime failure), and nothing half-written left behind.

Most cases fail before anything compiles, so they run in this process through
``jaxmp.cli.main`` (the console script's own function), with stderr captured at the file
descriptor; a sample also runs as real subprocesses. ``python tests/test_bad_input.py`` prints
the table of docs/reliability.md (the exact message each case gets).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # the table: 8 simulated devices, like the test session
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# A small, fast model on an explicit mesh (no planning) with synthetic tokens: each case
# changes one thing. 8 devices, as tests/conftest.py provides.
BASE = ["model.layers=1", "model.d_model=32", "model.heads=4", "data.seq_len=16",
        "data.source=synthetic", "train.batch_size=8", "train.steps=2", "train.eval_every=0",
        "mesh.data=2", "mesh.fsdp=4", "logging.tensorboard=false", "logging.progress=false"]


@dataclass
class Case:
    """``args(tmp)`` → the CLI arguments (it may create files under ``tmp``)."""

    name: str
    args: Callable[[Path], list[str]]
    code: int
    needle: str
    subprocess: bool = False


def sets(*kv: str) -> list[str]:
    return [a for pair in kv for a in ("--set", pair)]


def train(*kv: str, base: bool = True, extra: tuple[str, ...] = ()) -> Callable[[Path], list]:
    return lambda tmp: ["train", *sets(*(BASE if base else []), *kv), "--run-dir",
                        str(tmp / "run"), *extra]


def config_file(text: bytes, *kv: str) -> Callable[[Path], list]:
    def make(tmp: Path) -> list:
        (tmp / "bad.toml").write_bytes(text)
        return ["train", str(tmp / "bad.toml"), *sets(*kv), "--run-dir", str(tmp / "run")]
    return make


def token_file(values: list[int] | bytes, *kv: str, dtype: str = "<u2") -> Callable[[Path], list]:
    def make(tmp: Path) -> list:
        data = values if isinstance(values, bytes) else np.asarray(values, dtype).tobytes()
        (tmp / "tokens.bin").write_bytes(data)
        return train(f"data.source={tmp / 'tokens.bin'}", *kv)(tmp)
    return make


def in_run_dir(setup: Callable[[Path], None], *kv: str, command: str = "train",
               extra: tuple[str, ...] = ()) -> Callable[[Path], list]:
    """Prepare ``tmp/run`` (e.g. a checkpoint) first, then run ``command`` on it."""
    def make(tmp: Path) -> list:
        setup(tmp / "run")
        if command == "train":
            return train(*kv)(tmp)
        return ["ckpt", command, str(tmp / "run"), *extra]
    return make


def foreign_checkpoint(run: Path) -> None:
    """A checkpoint of a different model in the run's checkpoints folder."""
    import jax.numpy as jnp

    from jaxmp import checkpoint

    checkpoint.save(run / "checkpoints", 3, {"params": {"w": jnp.zeros((4, 4))}})


def _tiny_checkpoint(run: Path) -> Path:
    import jax.numpy as jnp

    from jaxmp import checkpoint

    return checkpoint.save(run / "checkpoints", 3,
                           {"params": {"w": jnp.arange(4096, dtype=jnp.float32)}})


def truncated_checkpoint(run: Path) -> None:
    for f in _array_files(_tiny_checkpoint(run)):
        f.write_bytes(f.read_bytes()[:7])


def corrupted_checkpoint(run: Path) -> None:
    """One bit flipped inside the array bytes: only the checksum can tell."""
    f = max(_array_files(_tiny_checkpoint(run)), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x10
    f.write_bytes(bytes(data))


def _array_files(step_dir: Path) -> list[Path]:
    return [f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"]


def file_in_the_way(tmp: Path) -> list:
    (tmp / "afile").write_text("x")
    return ["train", *sets(*BASE), "--run-dir", str(tmp / "afile" / "run")]


CASES = [
    # -- config: keys, types, values, files (no jax needed)
    Case("unknown key", train("train.stpes=3"), 2, "unknown config key 'train.stpes'"),
    Case("unknown section", train("trainer.steps=3"), 2, "unknown config section 'trainer'"),
    Case("unknown mesh axis", train("mesh.expert=2"), 2, "unknown config key 'mesh.expert'"),
    Case("wrong type (int)", train("train.steps=abc"), 2, "train.steps: expected an integer"),
    Case("wrong type (1.5 for an int)", train("train.steps=1.5"), 2, "train.steps"),
    Case("wrong type (bool)", train("checkpoint.async_save=3"), 2, "expected a boolean"),
    Case("negative learning rate", train("optimizer.lr=-1"), 2, "optimizer.lr: must be > 0"),
    Case("zero learning rate", train("optimizer.lr=0"), 2, "optimizer.lr: must be > 0"),
    Case("NaN learning rate", train("optimizer.lr=nan"), 2, "optimizer.lr: expected a finite"),
    Case("infinite learning rate", train("optimizer.lr=inf"), 2, "optimizer.lr"),
    Case("malformed override", lambda tmp: ["train", "--set", "trainsteps"], 2, "trainsteps"),
    Case("bad TOML", config_file(b"[train\nsteps = 3\n"), 2, "invalid TOML"),
    Case("config not UTF-8", config_file(b"[train]\nsteps = \xff\n"), 2, "cannot read"),
    Case("section that is not a table", config_file(b"train = 3\n"), 2,
         r"train: expected a \[section\] table"),
    Case("missing config", lambda tmp: ["train", str(tmp / "nope.toml")], 2,
         "config file not found"),
    Case("microbatches not dividing the batch", train("train.batch_size=10", "train.microbatches=3"),
         2, "train.batch_size: must be divisible by train.microbatches=3"),
    Case("heads not dividing d_model", train("model.heads=3"), 2, "model.d_model"),
    Case("two mesh axes set to -1", train("mesh.data=-1", "mesh.fsdp=-1"), 2, "only one mesh"),
    Case("zero-size mesh axis", train("mesh.tensor=0"), 2, "mesh.tensor: must be >= 1"),
    Case("train.max_skipped 0", train("train.max_skipped=0"), 2, "train.max_skipped"),
    Case("master_weights not a choice", train("train.master_weights=fp32"), 2,
         "train.master_weights: must be one of 'auto', 'float32', 'none'"),
    Case("sequence_parallel neither a boolean nor auto", train("train.sequence_parallel=yes"), 2,
         "train.sequence_parallel: expected a boolean or 'auto'"),
    Case("sequence parallel on a sequence tensor does not divide",
         train("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=8", "data.seq_len=12",
               "train.sequence_parallel=true"), 2,
         "train.sequence_parallel=true: the sequence length 12 does not divide over "
         "mesh.tensor=8"),
    Case("data source that is not a token file", train("data.source=corpus.txt"), 2,
         "data.source"),
    Case("uint16 tokens for a vocab > 65536", train("data.source=x.bin", "model.vocab_size=70000"),
         2, "uint16 cannot hold"),
    Case("steps 0", train("train.steps=0"), 2, "train.steps: must be >= 1"),
    Case("--simulate-devices 0", train(extra=("--simulate-devices", "0")), 2,
         "--simulate-devices"),
    Case("--coordinator without a process id", train(extra=("--coordinator", "127.0.0.1:1")),
         2, "--coordinator needs --num-processes and --process-id"),
    # -- mesh and batch (the trainer, before compiling)
    Case("mesh product != device count", train("mesh.data=3", "mesh.fsdp=1"), 2,
         "needs 3 devices but 8 are available"),
    Case("mesh -1 that cannot fill the devices", train("mesh.data=3", "mesh.fsdp=-1"), 2,
         "cannot fill 8 devices"),
    Case("batch not divisible by the batch axes", train("train.batch_size=12", "mesh.data=8",
                                                        "mesh.fsdp=1"),
         2, "train.batch_size: 12 does not divide over the 8 batch shards"),
    Case("microbatch not divisible by the batch axes",
         train("train.batch_size=16", "train.microbatches=4", "mesh.data=8", "mesh.fsdp=1"),
         2, "4 rows per microbatch, which do not divide over the 8 batch shards"),
    # -- pipeline stages (mesh.stage > 1)
    Case("1F1B with fewer microbatches than stages",
         train("mesh.data=1", "mesh.stage=2", "model.layers=2", "pipeline.schedule=1f1b",
               "train.microbatches=1"),
         2, r"train.microbatches: 1f1b needs at least as many microbatches as stages \(2\)"),
    Case("fewer layers than stages x virtual stages",
         train("mesh.data=1", "mesh.stage=2", "pipeline.schedule=interleaved",
               "pipeline.virtual_stages=2", "train.microbatches=2"),
         2, "1 blocks cannot fill 2 stages x 2 virtual stages"),
    Case("batch not divisible by microbatches x batch shards",
         train("mesh.data=1", "mesh.stage=2", "model.layers=2", "train.microbatches=4"),
         2, r"train.batch_size=8 does not split into train.microbatches=4 x 4 batch shards"),
    # -- data
    Case("missing data file", train("data.source=/nonexistent/tokens.bin"), 2,
         "data file not found: /nonexistent/tokens.bin"),
    Case("empty data file", token_file(b""), 2, "has 0 bytes"),
    Case("truncated data file", token_file(b"\x01\x00\x02"), 2,
         "has 3 bytes, not a whole positive number of uint16 tokens"),
    Case("token ids >= vocab", token_file([1, 2, 300] * 20), 2,
         "token id 300 >= vocab_size 256"),
    Case("a sequence longer than the data", token_file(list(range(10)), "data.seq_len=64",
                                                       "data.eval_fraction=0"),
         2, r"the train split of data.source .*tokens.bin has 10 tokens, fewer than one window "
            r"of seq_len \+ 1 = 65"),
    Case("training that diverges (runtime)", train(
        "optimizer.lr=1e30", "optimizer.warmup_steps=0", "train.steps=20", "logging.every=1",
        "checkpoint.every=0"), 1, r"5 consecutive steps \(2\.\.6\) had a non-finite loss or "
                                r"gradient \(train.max_skipped=5\)"),
    # -- run directory
    Case("run dir that cannot be created", file_in_the_way, 2,
         "run directory .*afile/run cannot be created: .*afile is a file"),
    # -- checkpoints
    Case("checkpoint from another model", in_run_dir(foreign_checkpoint), 2,
         r"does not fit the configured model: \d+ arrays of the model are not in the checkpoint "
         r"\(e.g. params/.*\); 1 arrays of the checkpoint are not in the model \(e.g. params/w\)"),
    Case("truncated checkpoint", in_run_dir(truncated_checkpoint, command="inspect",
                                            extra=("--digest",)),
         2, "is damaged or unreadable"),
    Case("corrupted checkpoint (one bit flipped)",
         in_run_dir(corrupted_checkpoint, command="inspect", extra=("--digest",)), 2,
         "array params/w does not match its checksum"),
    Case("unknown step", in_run_dir(lambda run: _tiny_checkpoint(run), command="inspect",
                                    extra=("--step", "99")),
         2, "no checkpoint for step 99 .*; complete steps: 3"),
    Case("checkpoint folder not found", lambda tmp: ["ckpt", "list", str(tmp / "nowhere")], 2,
         "checkpoint directory not found"),
    # -- the same kinds, as real processes
    Case("unknown key (subprocess)", train("train.stpes=3"), 2, "train.stpes", True),
    Case("bad TOML (subprocess)", config_file(b"[train\n"), 2, "invalid TOML", True),
    Case("batch not divisible (subprocess)",
         train("train.batch_size=12", "mesh.data=8", "mesh.fsdp=1"), 2,
         "12 does not divide over the 8 batch shards", True),
    Case("run dir that cannot be created (subprocess)", file_in_the_way, 2, "is a file", True),
    Case("checkpoint from another model (subprocess)", in_run_dir(foreign_checkpoint), 2,
         "does not fit the configured model", True),
]


def run_cli(args: list[str]) -> tuple[int, str]:
    """``jaxmp ARGS`` in this process; (exit code, everything written to fd 2)."""
    from jaxmp.cli import main

    with tempfile.TemporaryFile() as err:
        saved, saved_stream = os.dup(2), sys.stderr
        sys.stderr.flush()
        os.dup2(err.fileno(), 2)
        sys.stderr = open(2, "w", closefd=False)  # under pytest, sys.stderr is not fd 2
        try:
            code = main(args)
        finally:
            sys.stderr.flush()
            sys.stderr = saved_stream
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        return code, err.read().decode(errors="replace")


def run_subprocess(args: list[str]) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS":
           "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "jaxmp.cli", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)
    return r.returncode, r.stderr


def messages(stderr: str) -> list[str]:
    """The lines jaxmp printed (XLA / absl log lines, prefixed with a level letter, aside)."""
    return [line for line in stderr.splitlines()
            if line.strip() and not re.match(r"^[WIE]\d{4} ", line)]


def leftovers(tmp: Path) -> list[str]:
    """Half-written files and partial checkpoints under ``tmp``."""
    return [str(p) for p in tmp.rglob("*") if p.name.endswith(".tmp") or
            "orbax-checkpoint-tmp" in p.name]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_clear_line(case: Case, tmp_path: Path) -> None:
    args = case.args(tmp_path)
    code, stderr = (run_subprocess if case.subprocess else run_cli)(args)
    lines = messages(stderr)
    assert code == case.code, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]
    prefix = "jaxmp: error: " if case.code == 2 else "jaxmp: failed: "
    assert lines[0].startswith(prefix) and re.search(case.needle, lines[0]), lines[0]
    assert "Traceback" not in stderr
    assert not leftovers(tmp_path)
    if case.code == 2:
        assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing started training


def test_a_weight_axis_that_shards_nothing_is_a_warning_naming_the_fallback(capfd) -> None:
    """mesh.tensor=8 where no weight dimension divides by 8: the run would hold 8 copies."""
    import jaxmp
    from jaxmp.recipes.gpt import gpt_trainer

    config = jaxmp.load_config(None, BASE + ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=8",
                                             "model.mlp_dim=36", "model.vocab_size=260"])
    gpt_trainer(config, with_data=False)
    lines = messages(capfd.readouterr().err)
    assert len(lines) == 1, lines
    assert re.search(r"^jaxmp: warning: mesh axis tensor=8 shards no parameter \(e.g. "
                     r"\S+ dim \d \('\w+', size \d+\) is not divisible by tensor=8\); the rules "
                     r"fell back to replicating every parameter over it", lines[0]), lines[0]
    assert not any("fsdp" in line for line in lines)


def test_the_catalogue_is_long_enough() -> None:
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)


def table() -> str:
    """The markdown table of docs/reliability.md: case, exit code, the exact line."""
    rows = ["| case | exit | message |", "|---|---|---|"]
    for case in CASES:
        if case.subprocess:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            code, stderr = run_cli(case.args(Path(tmp)))
            line = (messages(stderr) or ["(nothing)"])[0].replace(tmp, "$TMP")
        rows.append(f"| {case.name} | {code} | `{line.replace('|', '/')}` |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
