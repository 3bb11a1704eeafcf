"""Hugging Face Llama / Mistral / Qwen2 checkpoints in and out (`jaxmp ckpt import`,
`jaxmp train --init-from`, `jaxmp ckpt export --format llama`), checked against an independent
numpy implementation of the three models (tests/hf_reference.py): logits, greedy decoding,
the first fine-tuning loss, bit-for-bit export, the same on an fsdp x tensor mesh, bad input."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_reference as ref
import jaxmp
from jaxmp import checkpoint
from jaxmp.cli import main
from jaxmp.data.tokenizer import byte_tokenizer
from jaxmp.models.decode import generate
from jaxmp.recipes.gpt import lm_batches
from jaxmp.recipes.gpt_config import load_config
from jaxmp.recipes.hf import hf_config, import_run
from jaxmp.recipes.sample import Sampler

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
          "original_max_position_embeddings": 64}
# Shapes that exercise every mapping choice: grouped-query and plain multi-head attention, a
# head_dim that is not d_model / heads, tied and untied heads (a tied one also stored, as some
# repositories do), llama3 rope scaling (with theta 5e5 and head_dim 32 all three of its
# frequency bands are populated), Qwen2's biases, fp32 / fp16 / bf16, sharded indexes.
CASES = {
    "llama": dict(arch="LlamaForCausalLM", vocab=320, d=64, layers=2, heads=4, kv=2, head_dim=32,
                  mlp=96, tied=False, dtype="float32", theta=500000.0, rope_scaling=LLAMA3),
    "mistral": dict(arch="MistralForCausalLM", vocab=288, d=64, layers=2, heads=4, kv=4,
                    head_dim=24, mlp=128, tied=True, dtype="float16", files=3, theta=1e6,
                    extra={"sliding_window": None}),
    "qwen2": dict(arch="Qwen2ForCausalLM", vocab=300, d=48, layers=3, heads=6, kv=2, head_dim=8,
                  mlp=80, tied=True, dtype="bfloat16", files=2, theta=1e6, store_tied_head=True,
                  extra={"use_sliding_window": False, "sliding_window": 4096}),
}
ONE = [jax.devices()[0]]


def rel_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    """max |ours - theirs| / max |theirs| (the logits' scale)."""
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, tuple[Path, dict, dict]]:
    """Each case's HF folder, its tensors and its config.json."""
    out = {}
    for name, case in CASES.items():
        folder = tmp_path_factory.mktemp(f"hf-{name}")
        tensors = ref.make_checkpoint(folder, **case)
        if name == "llama":  # a tokenizer to sample with: byte-level, 256 of the 320 ids
            byte_tokenizer().save(str(folder / "tokenizer.json"))
        out[name] = folder, tensors, json.loads((folder / "config.json").read_text())
    return out


@pytest.fixture(scope="module")
def runs(hf, tmp_path_factory) -> dict[str, Path]:
    """Each case imported by `jaxmp ckpt import` (params built on all 8 devices, fsdp)."""
    root = tmp_path_factory.mktemp("runs")
    for name, (folder, _, _) in hf.items():
        keep = ["--set", "model.param_dtype=bfloat16"] if name == "qwen2" else []  # as stored
        assert main(["ckpt", "import", str(folder), "--out", str(root / name), *keep]) == 0
    return {name: root / name for name in hf}


@pytest.fixture(scope="module")
def models(runs) -> dict[str, Sampler]:
    return {name: Sampler.load(run, mesh=jaxmp.make_mesh({"fsdp": 1}, ONE))
            for name, run in runs.items()}


@pytest.mark.parametrize("name", CASES)
def test_run_directory_and_config(name, hf, runs):
    folder, tensors, source = hf[name]
    run = runs[name]
    config = load_config(run / "config.toml")
    m, case = config.model, CASES[name]
    assert (m.layers, m.d_model, m.heads, m.kv_heads, m.head_dim, m.mlp_dim, m.vocab_size) == (
        case["layers"], case["d"], case["heads"], case["kv"], case["head_dim"], case["mlp"],
        case["vocab"])
    assert (m.activation, m.tie_embeddings, m.qkv_bias, m.rope_theta, m.norm_eps) == (
        "swiglu", case["tied"], name == "qwen2", case["theta"], 1e-6)
    assert m.rope_scaling == ("llama3" if name == "llama" else "none")
    assert m.param_dtype == ("bfloat16" if name == "qwen2" else "float32")
    assert config.optimizer.lr == 2e-5  # a fine-tuning rate, not the tiny model's 3e-3
    info = checkpoint.info(run)
    assert info["step"] == 0 and all(p.startswith("params/") for p in info["meta"]["arrays"])
    assert (run / "tokenizer.json").is_file() == (name == "llama")
    assert json.loads((run / "hf" / "config.json").read_text()) == source
    assert not list(run.parent.glob(".*importing"))


@pytest.mark.parametrize("name", CASES)
def test_logits_equal_the_reference(name, hf, models):
    _, tensors, config = hf[name]
    ids = np.random.default_rng(1).integers(0, CASES[name]["vocab"], 40)
    ours = np.asarray(models[name].model(jnp.asarray(ids[None], jnp.int32))[0])
    theirs = ref.forward(tensors, config, ids)
    assert np.abs(theirs).max() > 1  # far from zero: the comparison means something
    assert rel_error(ours, theirs) <= 1e-4


def test_a_larger_vocabulary_pads_with_zero_rows(hf, tmp_path):
    folder, tensors, config = hf["llama"]
    assert main(["ckpt", "import", str(folder), "--out", str(tmp_path / "run"),
                 "--set", "model.vocab_size=384"]) == 0
    model = Sampler.load(tmp_path / "run", mesh=jaxmp.make_mesh({"fsdp": 1}, ONE)).model
    assert not np.asarray(model.embed[...])[320:].any()
    assert not np.asarray(model.unembed[...])[:, 320:].any()
    ids = np.arange(30) * 7 % 320
    ours = np.asarray(model(jnp.asarray(ids[None], jnp.int32))[0])
    assert ours.shape == (30, 384) and not ours[:, 320:].any()
    assert rel_error(ours[:, :320], ref.forward(tensors, config, ids)) <= 1e-4


def test_llama3_scaling_and_biases_matter(hf):
    """The test checkpoints would catch a missing rope scaling or a dropped bias."""
    _, tensors, config = hf["llama"]
    ids = np.arange(40) % 300
    plain = ref.forward(tensors, {**config, "rope_scaling": None}, ids)
    assert rel_error(plain, ref.forward(tensors, config, ids)) > 1e-2
    _, tensors, config = hf["qwen2"]
    unbiased = {k: v for k, v in tensors.items() if not k.endswith(".bias")}
    assert rel_error(ref.forward(unbiased, config, ids), ref.forward(tensors, config, ids)) > 1e-2


@pytest.mark.parametrize("name", CASES)
def test_greedy_decode_equals_the_reference(name, hf, models):
    _, tensors, config = hf[name]
    prompt = [5, 17, 99, 3, 250, 42]
    out = generate(models[name].model, np.array([prompt], np.int32), jax.random.key(0), 12,
                   temperature=0)
    assert np.asarray(out)[0].tolist() == ref.greedy(tensors, config, prompt, 12)


def test_sample_cli_decodes_with_the_imported_tokenizer(hf, runs, capsys):
    _, tensors, config = hf["llama"]
    assert main(["sample", str(runs["llama"]), "--prompt", "Hi", "--tokens", "8",
                 "--temperature", "0"]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    ids = ref.greedy(tensors, config, list(b"Hi"), 8, limit=256)  # only the tokenizer's ids
    assert text == "Hi" + byte_tokenizer().decode(ids)


@pytest.mark.parametrize("name", CASES)
def test_export_gives_back_the_same_tensors(name, hf, runs, tmp_path):
    folder, _, source = hf[name]
    shard = ["--max-shard-size", "40KB"] if name != "llama" else []
    assert main(["ckpt", "export", str(runs[name]), "--format", "llama", "--out",
                 str(tmp_path), *shard]) == 0
    before, after = ref.load_checkpoint(folder), ref.load_checkpoint(tmp_path)
    if CASES[name]["tied"]:
        before.pop("lm_head.weight", None)
    assert sorted(after) == sorted(before)
    for k, v in before.items():
        assert after[k].dtype == v.dtype and after[k].shape == v.shape, k
        assert after[k].tobytes() == v.tobytes(), k
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert (len(files) > 1) == bool(shard) and (tmp_path / "model.safetensors.index.json"
                                                 ).is_file() == bool(shard)
    exported = json.loads((tmp_path / "config.json").read_text())
    for key in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings",
                "max_position_embeddings", "bos_token_id", "torch_dtype"):
        assert exported[key] == source[key], key
    if name == "llama":
        tokenizer = (tmp_path / "tokenizer.json").read_bytes()
        assert tokenizer == (folder / "tokenizer.json").read_bytes()


def test_export_in_another_dtype(runs, tmp_path, hf):
    assert main(["ckpt", "export", str(runs["qwen2"]), "--format", "llama", "--out",
                 str(tmp_path), "--dtype", "float32"]) == 0
    after, before = ref.load_checkpoint(tmp_path), ref.load_checkpoint(hf["qwen2"][0])
    assert all(v.dtype == np.float32 for v in after.values())
    np.testing.assert_array_equal(after["model.norm.weight"],
                                  before["model.norm.weight"].astype(np.float32))
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float32"


def test_fsdp_x_tensor_import_equals_one_device(hf, runs, tmp_path):
    """Built on a 4 x 2 mesh, the params are the same bits; the model on a 2 x 2 mesh gives
    the single device's logits (to float32 rounding of the sharded sums)."""
    folder = hf["llama"][0]
    config = hf_config(folder)
    import_run(folder, tmp_path / "mesh", config,
               mesh=jaxmp.make_mesh({"fsdp": 4, "tensor": 2}))
    one = jaxmp.make_mesh({"fsdp": 1}, ONE)
    a, b = (checkpoint.restore(r, mesh=one) for r in (runs["llama"], tmp_path / "mesh"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    mesh = jaxmp.make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[:4])
    sharded = Sampler.load(tmp_path / "mesh", mesh=mesh).model
    assert sharded.blocks.attn.q[...].sharding.spec[1:3] == ("fsdp", "tensor")
    single = Sampler.load(runs["llama"], mesh=one).model
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 320, (1, 24)), jnp.int32)
    with jaxmp.rules.activation_sharding(mesh):
        logits = np.asarray(jax.jit(lambda t: sharded(t))(ids))
    # the same params; only the order of the sharded sums differs
    assert rel_error(logits, np.asarray(jax.jit(lambda t: single(t))(ids))) <= 1e-5


TRAIN = ["--set", "data.source=synthetic", "--set", "data.seq_len=16", "--set",
         "train.batch_size=8", "--set", "train.steps=1", "--set", "logging.every=1",
         "--set", "train.eval_every=0", "--set", "mesh.stage=1",
         "--set", "logging.progress=false", "--set", "logging.tensorboard=false"]


def _first_loss(run: Path) -> float:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]


def _reference_loss(run: Path, tensors: dict, config: dict) -> float:
    batch = next(iter(lm_batches(load_config(run / "config.toml"))))
    return ref.loss(tensors, config, batch["inputs"], batch["targets"])


def test_fine_tuning_an_imported_run_starts_from_the_reference_loss(hf, runs, tmp_path):
    """`jaxmp train --run-dir RUN` on a Qwen2 imported as bf16: the run's config.toml, the
    imported params (cast to float32 master weights), a fresh optimizer state."""
    _, tensors, config = hf["qwen2"]
    run = tmp_path / "run"
    shutil.copytree(runs["qwen2"], run)
    assert main(["train", "--run-dir", str(run), *TRAIN, "--set", "mesh.data=8",
                 "--set", "mesh.fsdp=1", "--set", "mesh.tensor=1",
                 "--set", "model.param_dtype=float32"]) == 0
    assert abs(_first_loss(run) - _reference_loss(run, tensors, config)) <= 1e-4 * \
        _reference_loss(run, tensors, config)
    state = checkpoint.restore(run, what="state", mesh=jaxmp.make_mesh({"fsdp": 1}, ONE))
    assert int(state["step"]) == 1 and "opt_state" in state
    assert state["params"]["embed"].dtype == jnp.float32


def test_init_from_imports_and_fine_tunes_on_a_mesh(hf, tmp_path):
    """`jaxmp train --init-from HF_DIR` on fsdp 2 x tensor 2: one command, the reference's
    first loss; a rerun resumes instead of importing again."""
    folder, tensors, config = hf["llama"]
    run = tmp_path / "run"
    args = ["train", "--init-from", str(folder), "--run-dir", str(run), *TRAIN,
            "--set", "mesh.data=2", "--set", "mesh.fsdp=2", "--set", "mesh.tensor=2"]
    assert main(args) == 0
    assert (run / "tokenizer.json").is_file() and (run / "hf" / "config.json").is_file()
    plan = json.loads((run / "plan.json").read_text())
    assert plan["mesh"]["fsdp"] == 2 and plan["mesh"]["tensor"] == 2
    first = _first_loss(run)
    assert abs(first - _reference_loss(run, tensors, config)) <= 1e-4 * first
    assert main(args + ["--set", "train.steps=2"]) == 0
    assert [s.step for s in checkpoint.list_steps(run)] == [0, 1, 2]


@pytest.mark.parametrize("sets,message", [
    (["model.rope_scaling=llama3", "model.rope_high_freq_factor=1.0"],
     "model.rope_high_freq_factor: must be > model.rope_low_freq_factor=1.0"),
    (["model.head_dim=15"], "model.head_dim: must be even"),
    (["model.rope_scaling=yarn"], "model.rope_scaling: must be one of 'none', 'llama3'"),
    (["model.rope_theta=0.5"], "model.rope_theta: must be > 1"),
])
def test_new_model_keys_are_validated(sets, message):
    with pytest.raises(jaxmp.errors.ConfigError, match=re.escape(message)):
        load_config(None, sets)


def test_cost_model_and_n_params_count_the_biases():
    from jaxmp.cost import model_costs
    from jaxmp.models import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(vocab_size=64, layers=2, d_model=32, heads=4, kv_heads=2, head_dim=8,
                    mlp_dim=64, activation="swiglu", qkv_bias=True)
    batch = {"inputs": jax.ShapeDtypeStruct((2, 8), jnp.int32),
             "targets": jax.ShapeDtypeStruct((2, 8), jnp.int32)}
    cost = model_costs(lambda rngs: GPT(cfg, rngs=rngs), batch, lm_loss, policies=("none",))
    assert cost.param_count == cfg.n_params
    block = next(lay for lay in cost.layers if lay.kind == "block")
    assert {p.path for p in block.params} >= {"blocks/attn/q_bias", "blocks/attn/k_bias",
                                              "blocks/attn/v_bias"}
    assert cfg.n_params - dataclasses.replace(cfg, qkv_bias=False).n_params == 2 * (4 + 4) * 8


# ------------------------------------------------------------------------------- bad input


def jaxmp_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": "", "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-m", "jaxmp.cli", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def _broken(hf, tmp_path: Path, name: str, change) -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(hf[name][0], folder)
    change(folder)
    return folder


def _edit_config(**keys):
    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **keys}))
    return change


def _reshape_k(folder: Path) -> None:
    tensors = ref.load_checkpoint(folder)
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)
    from safetensors.numpy import save_file

    save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.parametrize("name,change,message", [
    ("llama", _edit_config(architectures=["GPT2LMHeadModel"]),
     r"architecture 'GPT2LMHeadModel' cannot be imported; jaxmp maps LlamaForCausalLM, "
     r"MistralForCausalLM, Qwen2ForCausalLM"),
    ("llama", _reshape_k, r"tensor model.layers.1.self_attn.k_proj.weight has shape \[32, 64\], "
                          r"expected \[64, 64\]"),
    ("qwen2", lambda f: (f / "model.safetensors.index.json").write_text("{not json"),
     r"model.safetensors.index.json: not a JSON index"),
])
def test_bad_folders_through_the_cli(hf, tmp_path, name, change, message):
    folder = _broken(hf, tmp_path, name, change)
    r = jaxmp_cli("ckpt", "import", str(folder), "--out", str(tmp_path / "run"))
    err = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in err and "Traceback" not in err, err
    assert re.search(message, err), err
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".*importing"))


def _drop(name: str):
    def change(folder: Path) -> None:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        del index["weight_map"][name]
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return change


@pytest.mark.parametrize("name,change,sets,message", [
    ("qwen2", _drop("model.layers.2.self_attn.v_proj.bias"), [],
     "tensor model.layers.2.self_attn.v_proj.bias is missing (expected [16])"),
    ("mistral", lambda f: None, ["model.vocab_size=100"],
     "model.vocab_size: 100 is smaller than the 288-token vocabulary"),
    ("llama", lambda f: None, ["model.layers=1"],
     "model.layers: {hf} holds a model with layers = 2, which cannot change on import"),
    ("llama", lambda f: None, ["model.vocab_size=256", "model.tie_embeddings=false"],
     "model.vocab_size: 256 is smaller than the 320-token vocabulary"),
    ("llama", _edit_config(vocab_size=260), [],
     "tensor model.embed_tokens.weight has shape [320, 64], expected [260, 64]"),
    ("llama", _edit_config(vocab_size=400), [],
     "tensor model.embed_tokens.weight has shape [320, 64], expected [400, 64]"),
    ("llama", _edit_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), [],
     "rope_scaling type 'yarn' is not supported"),
    ("mistral", lambda f: (f / "model-00002-of-00003.safetensors").write_bytes(b"\x05"), [],
     "model-00002-of-00003.safetensors: not a safetensors file"),
])
def test_bad_input_is_one_line(hf, tmp_path, capsys, name, change, sets, message):
    folder = _broken(hf, tmp_path, name, change)
    args = ["ckpt", "import", str(folder), "--out", str(tmp_path / "run")]
    assert main(args + [x for s in sets for x in ("--set", s)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message.format(hf=folder) in err, err
    assert not (tmp_path / "run").exists()


def test_tokenizer_larger_than_the_vocabulary(hf, tmp_path, capsys):
    from tokenizers import Tokenizer, models

    folder = _broken(hf, tmp_path, "qwen2", lambda f: None)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(400)}, unk_token="w0")).save(
        str(folder / "tokenizer.json"))
    assert main(["ckpt", "import", str(folder), "--out", str(tmp_path / "run")]) == 2
    assert "tokenizer.json: has 400 tokens, more than model.vocab_size=300" in \
        capsys.readouterr().err


def test_a_failed_import_leaves_nothing(hf, tmp_path, monkeypatch):
    import jaxmp.checkpoint.hf.load as load

    def fail(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(load, "save", fail)
    with pytest.raises(OSError, match="disk on fire"):
        import_run(hf["llama"][0], tmp_path / "run", hf_config(hf["llama"][0]))
    assert list(tmp_path.iterdir()) == []


def test_import_refuses_a_run_directory_in_use(hf, runs, capsys):
    assert main(["ckpt", "import", str(hf["llama"][0]), "--out", str(runs["llama"])]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


# ------------------------------------------------------------------------ several processes

WORKER = """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, hf, out = sys.argv[1:]
jax.distributed.initialize(f"127.0.0.1:{port}", 2, int(pid))
import jaxmp
import jaxmp.checkpoint.hf.load as load
from jaxmp.recipes.hf import hf_config, import_run
cut, seen = load._cut, []

def counted(view, bounds, dtype):
    seen.append([list(b) for b in bounds])
    return cut(view, bounds, dtype)

load._cut = counted
import_run(hf, out, hf_config(hf), mesh=jaxmp.make_mesh({"fsdp": 4, "tensor": 2}))
with open(f"{out}.cut{pid}.json", "w") as f:
    json.dump(seen, f)
"""


@pytest.mark.slow
def test_two_processes_each_cut_only_their_devices_slices(hf, runs, tmp_path):
    """2 processes x 4 devices import onto one fsdp 4 x tensor 2 mesh: each copies exactly
    half of every tensor out of the files (its devices' slices), and the checkpoint — its
    checksums summed over both — equals the single-process import bit for bit."""
    from test_checkpoint_helpers import REPO, free_port, subprocess_env

    folder, out, port = hf["llama"][0], tmp_path / "run", free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(i), str(folder),
                               str(out)], cwd=REPO, env=subprocess_env(4),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    assert checkpoint.info(out)["meta"]["processes"] == 2
    sizes = [sum(int(np.prod([b - a for a, b in cut])) for cut in json.loads(
        Path(f"{out}.cut{i}.json").read_text())) for i in range(2)]
    total = sum(v.size for v in hf["llama"][1].values())
    assert sizes == [total // 2, total // 2]
    one = jaxmp.make_mesh({"fsdp": 1}, ONE)
    a, b = (checkpoint.restore(r, mesh=one) for r in (runs["llama"], out))  # checksums verified
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


# ----------------------------------------------------------------------------- the docs

DOC = Path(__file__).resolve().parents[1] / "docs" / "huggingface.md"


@pytest.mark.slow
def test_the_docs_walkthrough_runs_as_written(tmp_path):
    """docs/huggingface.md's end-to-end block, command by command (the download skipped: a
    random model of Qwen2's layout, with a tokenizer trained on the docs, stands in)."""
    import glob
    import shlex

    from jaxmp.data.tokenizer import train_bpe

    text = DOC.read_text()
    section = text[text.index("## Fine-tune a Llama-family model, end to end"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert commands[0][0] == "huggingface-cli" and all(c[0] == "jaxmp" for c in commands[1:])
    folder = Path(commands[0][commands[0].index("--local-dir") + 1])
    shutil.copytree(DOC.parent, tmp_path / "docs")
    shutil.copy(DOC.parent.parent / "README.md", tmp_path / "README.md")
    ref.make_checkpoint(tmp_path / folder, "Qwen2ForCausalLM", vocab=512, d=64, layers=2,
                        heads=4, kv=2, head_dim=16, mlp=128, tied=True, dtype="bfloat16",
                        files=2, theta=1e6)
    docs = [Path(p).read_text() for p in glob.glob(str(tmp_path / "docs" / "*.md"))]
    train_bpe(docs, 512).save(str(tmp_path / folder / "tokenizer.json"))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "PYTHONPATH": str(DOC.parent.parent)}
    outputs = []
    for cmd in commands[1:]:
        r = subprocess.run([sys.executable, "-m", "jaxmp.cli", *cmd[1:]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (cmd, r.stderr[-2000:])
        outputs.append(r.stdout)
    run = tmp_path / "runs" / "qwen"
    assert outputs[1].startswith("The planner") and outputs[4].startswith("The planner")
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["mesh"]["fsdp"], plan["mesh"]["tensor"]) == (4, 2)
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    # A random model at the walkthrough's fine-tuning rate (2e-5, 20 warm-up steps) hardly
    # moves in 100 steps: the loss is checked to be finite, the weights to have been trained.
    assert len(losses) == 10 and np.isfinite(losses).all()
    out = tmp_path / "hf" / "Qwen2.5-0.5B-docs"
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == ["Qwen2ForCausalLM"] and exported["torch_dtype"] == \
        "bfloat16" and (out / "tokenizer.json").is_file()
    trained, source = ref.load_checkpoint(out), ref.load_checkpoint(tmp_path / folder)
    assert trained["model.norm.weight"].dtype == ref.DTYPES["bfloat16"]
    name = "model.layers.0.mlp.down_proj.weight"
    assert trained[name].shape == source[name].shape and \
        trained[name].tobytes() != source[name].tobytes()
