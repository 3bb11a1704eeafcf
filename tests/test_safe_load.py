"""Loading never runs code: checkpoints and configs are parsed (JSON, TOML, raw array bytes),
never unpickled or evaluated. Crafted files are refused with a clear error, and the payload
they carry (``os.system("touch <marker>")`` on unpickling) never runs."""
from __future__ import annotations

import ast
import json
import os
import pickle
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jaxmp
from jaxmp import checkpoint
from jaxmp.checkpoint import CheckpointError, inspect_report
from jaxmp.config import ConfigError

PKG = Path(jaxmp.__file__).parent


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def payload(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


@pytest.fixture()
def saved(tmp_path):
    """A small checkpoint (step 3) and the path a payload would create."""
    mesh = jaxmp.make_mesh({}, jax.devices()[:1])
    state = {"step": jnp.int32(3), "params": {"w": jnp.arange(4096, dtype=jnp.float32)}}
    checkpoint.save(tmp_path / "ck", 3, jax.device_put(state, jax.NamedSharding(
        mesh, jax.sharding.PartitionSpec())))
    return tmp_path / "ck", tmp_path / "pwned"


def _every_reader(root: Path) -> list[str]:
    """Read the checkpoint every way jaxmp can; the errors, one line each."""
    errors = []
    for read in (lambda: checkpoint.restore(root, step=3),
                 lambda: checkpoint.info(root, step=3),
                 lambda: inspect_report(root, 3, with_digest=True),
                 lambda: checkpoint.restore(root)):  # the fallback path (latest readable)
        try:
            read()
        except CheckpointError as e:
            assert "\n" not in str(e)
            errors.append(str(e))
    return errors


def _array_file(step_dir: Path) -> Path:
    files = [f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    return max(files, key=lambda f: f.stat().st_size)


PLANTS = {
    # a pickle where jaxmp reads JSON: the meta item, the data item, Orbax's tree metadata
    "meta item": (lambda d: d / "meta" / "metadata", "cannot read 'meta'"),
    "data item": (lambda d: d / "data" / "metadata", None),
    "orbax tree metadata": (lambda d: d / "state" / "_METADATA", "damaged or unreadable"),
    # a pickle over the raw array bytes: read as numbers, caught by the checksum
    "array bytes": (_array_file, "damaged or unreadable|does not match its checksum"),
    # a pickle beside the files: never opened
    "extra file": (lambda d: d / "state" / "evil.pkl", None),
}


@pytest.mark.parametrize("where", list(PLANTS))
def test_a_pickle_dropped_into_a_checkpoint_runs_nothing(saved, where):
    root, marker = saved
    target, error = PLANTS[where]
    path = target(root / "3")
    if where == "data item":  # restore() does not read the data item; info() does
        (root / "3" / "data").mkdir(exist_ok=True)
    path.write_bytes(payload(marker))
    errors = _every_reader(root)
    assert not marker.exists(), f"the payload in the {where} ran"
    if error is None:
        assert not [e for e in errors if "data" not in e], errors
    else:
        assert errors and re.search(error, errors[0]), errors


META_MUTATIONS = {
    "arrays is a list": (lambda m: m.update(arrays=[1, 2]), "arrays is \\[1, 2\\]"),
    "shape is a string": (lambda m: m["arrays"]["params/w"].update(shape="[4096]"),
                          r"arrays\['params/w'\].shape is '\[4096\]'"),
    "negative size": (lambda m: m["arrays"]["params/w"].update(shape=[-1]), "shape is \\[-1\\]"),
    "object dtype": (lambda m: m["arrays"]["params/w"].update(dtype="object"),
                     "dtype is 'object', expected one of bool"),
    "code as dtype": (lambda m: m["arrays"]["params/w"].update(dtype="__import__('os')"),
                      "dtype is"),
    "names is a table": (lambda m: m["arrays"]["params/w"].update(names={"a": 1}), "names is"),
    "code as PRNG impl": (lambda m: m["arrays"]["params/w"].update(
        prng_impl="os.system('touch x')"), "prng_impl is"),
    "step is a string": (lambda m: m.update(step="3"), "step is '3', expected an integer"),
    "checksum is a number": (lambda m: m["arrays"]["params/w"].update(checksum=7), "checksum is"),
    "path escapes the tree": (lambda m: m["arrays"].update({"../../etc": m["arrays"].pop(
        "params/w")}), "array path '../../etc' is not a plain"),
    "spec holds a table": (lambda m: m["arrays"]["params/w"].update(spec=[{"a": 1}]), "spec is"),
}


@pytest.mark.parametrize("mutation", list(META_MUTATIONS))
def test_meta_with_an_unexpected_type_is_refused(saved, mutation):
    root, _ = saved
    change, message = META_MUTATIONS[mutation]
    meta_file = root / "3" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    change(meta)
    meta_file.write_text(json.dumps(meta))
    errors = _every_reader(root)
    assert len(errors) == 4, errors  # every way of reading refuses it
    assert re.search(r"has an invalid meta item: .*" + message, errors[0]), errors[0]


def test_configs_are_parsed_never_evaluated(tmp_path):
    marker = tmp_path / "pwned"
    code = f"__import__('os').system('touch {marker}')"
    cfg = tmp_path / "evil.toml"
    cfg.write_text(f'[model]\nactivation = "{code}"\n')
    with pytest.raises(ConfigError, match="model.activation: must be one of"):
        jaxmp.load_config(cfg)
    with pytest.raises(ConfigError, match="train.steps: expected an integer"):
        jaxmp.load_config(None, [f"train.steps={code}"])
    cfg.write_bytes(payload(marker))  # a pickle where TOML is expected
    with pytest.raises(ConfigError, match="evil.toml"):
        jaxmp.load_config(cfg)
    assert not marker.exists()


def test_no_loader_in_jaxmp_can_run_code():
    """The package imports no unpickler or YAML loader, calls no eval/exec/__import__, and
    never asks numpy for pickles (read from the source, so nothing is missed at run time)."""
    modules = {"pickle", "cloudpickle", "dill", "marshal", "shelve", "yaml", "joblib"}
    hits = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = any(n.split(".")[0] in modules for n in names)
            if isinstance(node, ast.Call):
                bad = (isinstance(node.func, ast.Name) and node.func.id in
                       ("eval", "exec", "__import__", "compile")) or any(
                    k.arg == "allow_pickle" for k in node.keywords)
            if bad:
                hits.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    assert not hits, hits
