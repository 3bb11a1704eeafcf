"""Config loading: defaults == tiny.toml, override parsing, one-line errors, TOML round trip."""

import dataclasses
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from jaxmp.config import (ConfigError, MeshConfig, OptimizerConfig, TrainConfig, TrainerConfig,
                          config_to_dict, config_to_toml, load, replace)
from jaxmp.config import io as config_io
from jaxmp.recipes.gpt_config import CONFIG_DIR, Config, ModelConfig, load_config

SHIPPED = ["tiny", "gpt2-small", "gpt-1b"]


def shipped(name: str) -> Path:
    return CONFIG_DIR / f"{name}.toml"


def assert_one_line_error(exc: pytest.ExceptionInfo, *needles: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg.strip() == msg and msg, repr(msg)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


# ---------------------------------------------------------------- defaults and shipped files
def test_defaults_equal_tiny_toml_exactly():
    assert load_config() == load_config(shipped("tiny")) == Config()
    # tiny.toml spells out every key, so it documents the whole schema: its raw TOML equals the
    # defaults key for key (a new field must be added to tiny.toml too).
    raw = tomllib.loads(shipped("tiny").read_text())
    assert raw == config_to_dict(Config())


def test_repo_root_configs_symlink_points_at_the_package_configs():
    root = Path(__file__).resolve().parent.parent / "configs"
    assert root.resolve() == CONFIG_DIR
    assert {f"{n}.toml" for n in SHIPPED} <= {p.name for p in root.glob("*.toml")}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load_and_round_trip(name, tmp_path):
    config = load_config(shipped(name))
    out = tmp_path / "effective.toml"
    out.write_text(config_to_toml(config))
    assert load_config(out) == config


def test_gpt2_small_values():
    c = load_config(shipped("gpt2-small"))
    m = c.model
    assert (m.layers, m.d_model, m.heads, m.vocab_size) == (12, 768, 12, 50304)
    assert (m.compute_dtype, m.remat, m.resolved_mlp_dim) == ("bfloat16", "auto", 3072)
    assert (c.data.seq_len, c.data.source, c.train.batch_size) == (1024, "synthetic", 64)
    assert (c.optimizer.lr, c.train.steps) == (6e-4, 5000)


def test_gpt_1b_values_and_size():
    c = load_config(shipped("gpt-1b"))
    m = c.model
    assert (m.layers, m.d_model, m.heads, m.activation, m.tie_embeddings) == (
        24, 2048, 16, "swiglu", False)
    assert (m.remat, m.compute_dtype, c.data.seq_len, c.train.batch_size) == (
        "auto", "bfloat16", 2048, 256)
    assert c.optimizer.lr == 3e-4 and c.mesh.is_auto
    # ~1.4B: attention 4·d², SwiGLU 3·d·mlp per layer, untied input + output embeddings.
    d, f = m.d_model, m.resolved_mlp_dim
    params = m.layers * (4 * d * d + 3 * d * f) + 2 * m.vocab_size * d
    assert 1.3e9 < params < 1.5e9
    assert c.xla.flags == ""  # jaxmp's GPU flags and the plan's apply unchanged


def test_config_module_needs_no_jax():
    """The CLI reads xla.flags before jax is imported, so loading a config must not import jax."""
    code = textwrap.dedent(f"""
        import sys
        from jaxmp.recipes.gpt_config import load_config
        load_config({str(shipped('gpt-1b'))!r})
        assert not any(m == "jax" or m.startswith(("jax.", "jaxlib")) for m in sys.modules)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------- overrides
@pytest.mark.parametrize("override, get, expected", [
    ("train.steps=100", lambda c: c.train.steps, 100),
    ("train.steps = 7", lambda c: c.train.steps, 7),
    ("optimizer.lr=1e-3", lambda c: c.optimizer.lr, 1e-3),
    ("optimizer.lr=1", lambda c: c.optimizer.lr, 1.0),           # float field takes an int
    ("model.tie_embeddings=false", lambda c: c.model.tie_embeddings, False),
    ("model.activation=swiglu", lambda c: c.model.activation, "swiglu"),   # bare string
    ('model.activation="swiglu"', lambda c: c.model.activation, "swiglu"),  # TOML string
    ("mesh.stage=auto", lambda c: c.mesh.stage, "auto"),
    ("mesh.fsdp=8", lambda c: c.mesh.fsdp, 8),
    ("mesh.data=-1", lambda c: c.mesh.data, -1),
    ("logging.profile_steps=[10, 20]", lambda c: c.logging.profile_steps, (10, 20)),
    ("logging.profile_steps=[]", lambda c: c.logging.profile_steps, ()),
    ("data.source=/data/tokens v2.bin", lambda c: c.data.source, "/data/tokens v2.bin"),
    ("xla.flags=--xla_a=1 --xla_b=true", lambda c: c.xla.flags, "--xla_a=1 --xla_b=true"),
    ("xla.flags=", lambda c: c.xla.flags, ""),
])
def test_override_values_parse_and_type_check(override, get, expected):
    value = get(load_config(None, [override]))
    assert value == expected and type(value) is type(expected)


def test_overrides_apply_after_the_file_in_order():
    c = load_config(shipped("gpt2-small"), ["train.steps=10", "train.steps=20", "model.layers=2"])
    assert (c.train.steps, c.model.layers, c.model.d_model) == (20, 2, 768)
    assert load_config(None, "train.steps=9").train.steps == 9  # a lone string is one override


@pytest.mark.parametrize("override, needle", [
    ("train.stpes=3", "train.stpes"),
    ("trian.steps=3", "trian"),
    ("steps=3", "steps=3"),                               # no section
    ("train.steps", "train.steps"),                       # no '='
    ("train.steps=abc", "train.steps"),
    ("train.steps=1.5", "train.steps"),
    ("train.steps=true", "train.steps"),
    ("train.steps=3\nseed = 4", "train.steps"),          # one value, not a TOML document
    ("train.steps=0", "train.steps"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.microbatches=5", "train.microbatches"),       # 32 % 5 != 0
    ("train.eval_every=-1", "train.eval_every"),
    ("model.heads=3", "model.heads"),                     # 128 % 3 != 0
    ("model.kv_heads=3", "model.kv_heads"),               # 4 % 3 != 0
    ("model.vocab_size=1", "model.vocab_size"),
    ("model.activation=relu", "model.activation"),
    ("model.remat=true", "model.remat"),
    ("data.seq_len=1", "data.seq_len"),
    ("data.source=tokens.txt", "data.source"),
    ("data.eval_fraction=0.5", "data.eval_fraction"),
    ("optimizer.lr=0", "optimizer.lr"),
    ("optimizer.lr=nan", "optimizer.lr"),
    ("optimizer.min_lr_ratio=1.5", "optimizer.min_lr_ratio"),
    ("optimizer.warmup_steps=-1", "optimizer.warmup_steps"),
    ("optimizer.beta1=1.0", "optimizer.beta1"),
    ("optimizer.beta2=-0.1", "optimizer.beta2"),
    ("optimizer.clip_norm=-1", "optimizer.clip_norm"),
    ("mesh.fsdp=0", "mesh.fsdp"),
    ("mesh.tensor=-2", "mesh.tensor"),
    ("mesh.tensor=many", "mesh.tensor"),
    ("checkpoint.every=-1", "checkpoint.every"),
    ("checkpoint.keep=0", "checkpoint.keep"),
    ("logging.every=0", "logging.every"),
    ("logging.profile_steps=[5, 5]", "logging.profile_steps"),
    ("logging.profile_steps=[1, 2, 3]", "logging.profile_steps"),
    ("logging.profile_steps=5", "logging.profile_steps"),
    ("xla.flags=xla_gpu_foo=true", "xla.flags"),
    ("xla.matmul_precision=fast", "xla.matmul_precision"),
])
def test_bad_overrides_raise_one_line_naming_the_key(override, needle):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    assert_one_line_error(exc, needle)


def test_error_messages_read_well():
    def message(*overrides: str) -> str:
        with pytest.raises(ConfigError) as exc:
            load_config(None, list(overrides))
        return assert_one_line_error(exc)

    assert message("train.stpes=3") == (
        "unknown config key 'train.stpes' (did you mean 'train.steps'?)")
    assert message("train.steps=abc") == "train.steps: expected an integer, got 'abc'"
    assert message("train.lr=1") == "unknown config key 'train.lr' (did you mean 'optimizer.lr'?)"
    assert "did you mean 'train'" in message("trian.steps=3")
    assert message("mesh.fsdp=x") == "mesh.fsdp: expected an integer or 'auto', got 'x'"
    assert message("model.activation=relu") == (
        "model.activation: must be one of 'gelu', 'swiglu', got 'relu'")
    assert "mesh.data and mesh.fsdp" in message("mesh.data=-1", "mesh.fsdp=-1")
    assert isinstance(ConfigError("x"), ValueError)  # callers may catch ValueError


# ---------------------------------------------------------------- bad files
BAD_FILES = {
    "unknown_section": ("[trian]\nsteps = 3\n", "trian"),
    "unknown_key": ("[train]\nstpes = 3\n", "train.stpes"),
    "wrong_type": ('[train]\nsteps = "many"\n', "train.steps"),
    "float_for_int": ("[model]\nlayers = 2.0\n", "model.layers"),
    "bool_for_int": ("[train]\nbatch_size = true\n", "train.batch_size"),
    "top_level_key": ("steps = 3\n", "steps"),
    "section_not_table": ("train = 3\n", "train"),
    "bad_choice": ('[model]\ncompute_dtype = "float16"\n', "model.compute_dtype"),
    "heads": ("[model]\nd_model = 100\nheads = 8\n", "model.d_model"),
    "microbatches": ("[train]\nbatch_size = 10\nmicrobatches = 4\n", "train.batch_size"),
    "vocab_vs_stdlib": ("[model]\nvocab_size = 100\n", "model.vocab_size"),
    "vocab_vs_uint16": ('[model]\nvocab_size = 100000\n[data]\nsource = "t.bin"\n',
                        "data.token_dtype"),
    "mesh_zero": ("[mesh]\ntensor = 0\n", "mesh.tensor"),
    "profile": ("[logging]\nprofile_steps = [3]\n", "logging.profile_steps"),
    "profile_types": ('[logging]\nprofile_steps = [1, "x"]\n', "logging.profile_steps"),
    "invalid_toml": ("[train\nsteps = 3\n", "invalid TOML"),
    "invalid_toml_value": ("[train]\nsteps = \n", "invalid TOML"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_raise_one_line_naming_the_key(name, tmp_path):
    text, needle = BAD_FILES[name]
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert_one_line_error(exc, needle)
    if name.startswith("invalid_toml") or name in ("unknown_key", "wrong_type", "top_level_key"):
        assert str(path) in str(exc.value)  # errors inside a file say which file


def test_missing_file_and_non_utf8(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "nope.toml")
    assert_one_line_error(exc, "config file not found", "nope.toml")
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path)  # a directory is not a config file
    assert_one_line_error(exc, "config file not found")
    binary = tmp_path / "latin1.toml"
    binary.write_bytes(b'[data]\nsource = "caf\xe9.bin"\n')
    with pytest.raises(ConfigError) as exc:
        load_config(binary)
    assert_one_line_error(exc, "latin1.toml")


def test_file_keys_not_given_keep_defaults(tmp_path):
    path = tmp_path / "partial.toml"
    path.write_text("[train]\nsteps = 12\n[mesh]\ntensor = 2\n")
    c = load_config(path)
    assert c.train.steps == 12 and c.mesh.tensor == 2
    assert c.model == ModelConfig() and c.optimizer == Config().optimizer


# ---------------------------------------------------------------- writing back
def test_round_trip_with_awkward_values(tmp_path):
    c = load_config(None, [
        'data.source="/tmp/we\\"ird \\\\ pa\\u00e9th\\t\\u0001\U0001F600.bin"',
        "logging.profile_steps=[3, 9]", "mesh.fsdp=-1", "mesh.tensor=2",
        "optimizer.eps=1e-12", "optimizer.lr=100", "model.norm_eps=0.000001",
        "xla.flags=--xla_a=1  --xla_b", "checkpoint.async_save=false",
    ])
    assert c.data.source == '/tmp/we"ird \\ pa\u00e9th\t\x01\U0001F600.bin'
    text = config_to_toml(c)
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    assert load_config(path) == c
    assert tomllib.loads(text) == config_to_dict(c)


def test_config_to_dict_is_plain_json():
    d = config_to_dict(load_config(None, ["logging.profile_steps=[1, 4]"]))
    assert d["logging"]["profile_steps"] == [1, 4]
    assert list(d) == [  # the trainer's sections, then the GPT recipe's
        "mesh", "optimizer", "train", "checkpoint", "logging", "xla", "device", "pipeline",
        "compression", "model", "data"]
    assert json.loads(json.dumps(d)) == d


# ---------------------------------------------------------------- helpers for other modules
@pytest.mark.parametrize("d_model, activation, mlp_dim, expected", [
    (128, "gelu", 0, 512), (128, "swiglu", 0, 384), (768, "swiglu", 0, 2048),
    (2048, "swiglu", 0, 5504), (128, "swiglu", 200, 200),
])
def test_resolved_mlp_dim(d_model, activation, mlp_dim, expected):
    m = ModelConfig(d_model=d_model, heads=4, activation=activation, mlp_dim=mlp_dim)
    assert m.resolved_mlp_dim == expected


def test_resolved_heads():
    m = ModelConfig(d_model=128, heads=8)
    assert (m.resolved_kv_heads, m.resolved_head_dim) == (8, 16)
    gqa = ModelConfig(d_model=128, heads=8, kv_heads=2, head_dim=32)
    assert (gqa.resolved_kv_heads, gqa.resolved_head_dim) == (2, 32)
    assert ModelConfig(d_model=100, heads=3, head_dim=32).resolved_head_dim == 32


def test_mesh_helpers():
    auto = MeshConfig()
    assert auto.is_auto and auto.explicit() == {}
    assert auto.sizes() == {"data": -1, "stage": 1, "fsdp": 1, "tensor": 1}
    m = load_config(None, ["mesh.fsdp=-1", "mesh.tensor=2"]).mesh
    assert not m.is_auto and m.explicit() == {"fsdp": -1, "tensor": 2}
    assert m.sizes() == {"data": 1, "stage": 1, "fsdp": -1, "tensor": 2}


def test_replace_and_direct_construction_are_validated():
    c = replace(Config(), train={"steps": 7}, model={"activation": "swiglu"})
    assert (c.train.steps, c.model.activation, c.train.batch_size) == (7, "swiglu", Config().train.batch_size)
    with pytest.raises(ConfigError, match=r"^train\.steps: must be >= 1, got 0$"):
        replace(c, train={"steps": 0})
    with pytest.raises(ConfigError, match=r"train\.stepz"):
        replace(c, train={"stepz": 3})
    with pytest.raises(ConfigError, match=r"^model\.layers: expected an integer, got '4'$"):
        ModelConfig(layers="4")
    with pytest.raises(ConfigError, match=r"^train\.batch_size: "):
        Config(train=TrainConfig(batch_size=6, microbatches=4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.train.steps = 3  # type: ignore[misc]
    assert TrainConfig(steps=5) == load_config(None, ["train.steps=5"]).train
    assert OptimizerConfig(lr=1).lr == 1.0 and type(OptimizerConfig(lr=1).lr) is float


def test_model_section_maps_onto_the_gpt_config():
    """Every GPTConfig field has a [model] key of the same name (the recipe maps them by name)."""
    from jaxmp.models import GPTConfig
    from jaxmp.recipes.gpt import gpt_config

    keys = {f.name for f in dataclasses.fields(ModelConfig)}
    assert {f.name for f in dataclasses.fields(GPTConfig)} <= keys
    g = gpt_config(load_config(None, ["model.d_model=96", "model.heads=3",
                                      "model.activation=swiglu", "model.kv_heads=1"]))
    assert (g.d_model, g.heads, g.kv_heads, g.head_dim, g.mlp_dim) == (96, 3, 1, 32, 256)


def test_renamed_keys_keep_working_with_one_deprecation_line(capsys, tmp_path: Path):
    """Outside scripts and old run configs use the keys before the rename (DESIGN.md's public
    contract): each maps to its new key (``bf16`` to ``bfloat16``) and says so once."""
    config_io._WARNED.clear()
    old = load_config(None, ["train.grad_accum=4", "train.grad_compression=bf16",
                             "train.powersgd_rank=8", "train.gather_dtype=int8"])
    new = load_config(None, ["train.microbatches=4", "compression.gradients=bfloat16",
                             "compression.powersgd_rank=8", "compression.weights=int8"])
    assert old == new
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 4 and "'train.grad_accum' is deprecated: use 'train.microbatches'" in err[0]
    toml = tmp_path / "old.toml"
    toml.write_text("[pipeline]\nmicrobatches = 8\n[train]\nerror_feedback = false\n")
    cfg = load_config(toml)
    assert cfg.train.microbatches == 8 and cfg.compression.error_feedback is False
    assert len([x for x in capsys.readouterr().err.splitlines() if x.strip()]) == 2
    with pytest.raises(ConfigError, match="compression.gradients"):
        load_config(None, ["compression.gradients=bf16"])  # one spelling under the new key
