"""Logical → mesh sharding rules: resolution semantics, trees, lint and activation constraints."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp
from jaxmp import rules
from jaxmp.mesh import mesh_shape
from jaxmp.rules import Fallback, resolve

SDS = jax.ShapeDtypeStruct
MESHES = {
    "data8": {"data": 8},
    "fsdp8": {"fsdp": 8},
    "tensor8": {"tensor": 8},
    "d2f2t2": {"data": 2, "fsdp": 2, "tensor": 2},
}


@pytest.fixture(scope="module")
def meshes():
    return {k: jaxmp.make_mesh(v) for k, v in MESHES.items()}


def spec(names, shape, mesh, rule_list=rules.DEFAULT_RULES):
    return rules.logical_spec(names, shape, mesh, rule_list)


# --- resolution semantics ---------------------------------------------------------------------


def test_default_rules_are_ordered_pairs():
    assert isinstance(rules.DEFAULT_RULES, tuple)
    assert rules.normalize_rules(rules.DEFAULT_RULES) == rules.DEFAULT_RULES
    names = [n for n, _ in rules.DEFAULT_RULES]
    # fallbacks come after the primary rule for the same name
    assert names.index("mlp") < len(names) - 1 - names[::-1].index("mlp")
    assert ("batch", ("data", "fsdp")) in rules.DEFAULT_RULES


def test_two_dims_wanting_the_same_axis_first_gets_it(meshes):
    r = (("a", "fsdp"),)
    assert spec(("a", "a"), (8, 8), meshes["fsdp8"], r) == P("fsdp")
    # the second dim then tries the next rule for the same name
    r2 = (("a", "fsdp"), ("a", "tensor"))
    mesh = jaxmp.make_mesh({"fsdp": 2, "tensor": 4})
    assert spec(("a", "a"), (8, 8), mesh, r2) == P("fsdp", "tensor")


def test_name_in_two_rules_tried_in_turn(meshes):
    r = (("x", "tensor"), ("x", "fsdp"))
    assert spec(("x",), (16,), meshes["tensor8"], r) == P("tensor")
    assert spec(("x",), (16,), meshes["fsdp8"], r) == P("fsdp")  # tensor has size 1 there
    mesh = jaxmp.make_mesh({"fsdp": 2, "tensor": 4})
    assert spec(("x",), (16,), mesh, r) == P("tensor")  # first rule wins when it fits


def test_rule_order_decides_between_dims():
    sizes = {"data": 1, "stage": 1, "fsdp": 8, "tensor": 1}
    r = (("mlp", "fsdp"), ("embed", "fsdp"))
    assert resolve(("embed", "mlp"), (64, 64), sizes, r).spec == P(None, "fsdp")
    assert resolve(("embed", "mlp"), (64, 64), sizes, r[::-1]).spec == P("fsdp")


def test_divisibility_fallback_recorded_and_next_rule_used():
    sizes = {"data": 1, "stage": 1, "fsdp": 8, "tensor": 1}
    res = resolve(("embed", "mlp"), (12, 64), sizes, rules.DEFAULT_RULES, path="w")
    assert res.spec == P(None, "fsdp")  # ("mlp", "fsdp") fallback fired instead
    assert res.fallbacks == (Fallback("w", 0, "embed", "fsdp", 8, 12),)
    # a name with two rules: the first axis does not divide, the second does
    r = (("x", "tensor"), ("x", "fsdp"))
    sizes2 = {"fsdp": 2, "tensor": 4}
    res2 = resolve(("x",), (6,), sizes2, r)
    assert res2.spec == P("fsdp")
    assert [(f.mesh_axis, f.axis_size, f.dim_size) for f in res2.fallbacks] == [("tensor", 4, 6)]


def test_multi_axis_rule_joint_and_partial(meshes):
    m = meshes["d2f2t2"]
    assert spec(("batch", "act_embed"), (8, 16), m) == P(("data", "fsdp"))
    res = resolve(("batch",), (2,), mesh_shape(m), rules.DEFAULT_RULES)
    assert res.spec == P("data")  # data fits, data*fsdp=4 does not divide 2
    assert [(f.logical, f.mesh_axis) for f in res.fallbacks] == [("batch", "fsdp")]
    # size-1 axes are skipped, leaving a single axis as a plain str (not a 1-tuple)
    assert spec(("batch",), (16,), meshes["data8"]) == P("data")
    assert spec(("batch",), (16,), meshes["fsdp8"]) == P("fsdp")


def test_size_one_and_missing_axes_skipped(meshes):
    r = (("x", ("stage", "tensor")), ("x", "nonexistent"), ("x", "data"))
    assert spec(("x",), (8,), meshes["data8"], r) == P("data")
    res = resolve(("x",), (8,), mesh_shape(meshes["fsdp8"]), r)
    assert res.spec == P() and res.fired == frozenset() and res.considered == {0, 1, 2}


def test_explicit_none_replicates_and_settles_dim(meshes):
    r = (("layers", None), ("layers", "fsdp"), ("embed", "fsdp"))
    res = resolve(("layers", "embed"), (8, 8), mesh_shape(meshes["fsdp8"]), r)
    assert res.spec == P(None, "fsdp")
    assert res.fired == {0, 2}  # the None rule counts as firing; the later layers rule never runs
    assert 1 not in res.considered


def test_trailing_nones_dropped(meshes):
    s = spec(("embed", "norm", None), (16, 4, 3), meshes["fsdp8"])
    assert s == P("fsdp") and len(s) == 1
    assert spec((None, None), (3, 3), meshes["fsdp8"]) == P()


# (names, shape) -> expected spec per mesh, for DEFAULT_RULES
MATRIX = [
    (("embed", "mlp"), (64, 256),
     dict(data8=P(), fsdp8=P("fsdp"), tensor8=P(None, "tensor"), d2f2t2=P("fsdp", "tensor"))),
    (("mlp", "embed"), (256, 64),
     dict(data8=P(), fsdp8=P(None, "fsdp"), tensor8=P("tensor"), d2f2t2=P("tensor", "fsdp"))),
    (("vocab", "embed"), (512, 64),
     dict(data8=P(), fsdp8=P(None, "fsdp"), tensor8=P("tensor"), d2f2t2=P("tensor", "fsdp"))),
    # embed=12 does not divide by 8: the vocab fallback shards the embedding table instead
    (("vocab", "embed"), (512, 12),
     dict(data8=P(), fsdp8=P("fsdp"), tensor8=P("tensor"), d2f2t2=P("tensor", "fsdp"))),
    (("embed", "heads", "head_dim"), (64, 8, 16),
     dict(data8=P(), fsdp8=P("fsdp"), tensor8=P(None, "tensor"), d2f2t2=P("fsdp", "tensor"))),
    (("heads", "head_dim", "embed"), (8, 16, 64),
     dict(data8=P(), fsdp8=P(None, None, "fsdp"), tensor8=P("tensor"),
          d2f2t2=P("tensor", None, "fsdp"))),
    (("embed", "kv_heads", "head_dim"), (64, 2, 16),  # 2 kv heads: tensor8 cannot split them
     dict(data8=P(), fsdp8=P("fsdp"), tensor8=P(), d2f2t2=P("fsdp", "tensor"))),
    (("norm",), (64,), dict(data8=P(), fsdp8=P("fsdp"), tensor8=P(), d2f2t2=P("fsdp"))),
    (("layers", "embed", "mlp"), (4, 64, 256),
     dict(data8=P(), fsdp8=P(None, "fsdp"), tensor8=P(None, None, "tensor"),
          d2f2t2=P(None, "fsdp", "tensor"))),
    (("batch", "seq", "act_embed"), (16, 32, 64),
     dict(data8=P("data"), fsdp8=P("fsdp"), tensor8=P(), d2f2t2=P(("data", "fsdp")))),
    (("batch", "seq", "act_mlp"), (16, 32, 256),
     dict(data8=P("data"), fsdp8=P("fsdp"), tensor8=P(None, None, "tensor"),
          d2f2t2=P(("data", "fsdp"), None, "tensor"))),
    (("batch", "seq", "act_vocab"), (16, 32, 512),
     dict(data8=P("data"), fsdp8=P("fsdp"), tensor8=P(None, None, "tensor"),
          d2f2t2=P(("data", "fsdp"), None, "tensor"))),
]


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_default_rules_on_standard_meshes(meshes, mesh_name):
    for names, shape, expected in MATRIX:
        got = spec(names, shape, meshes[mesh_name])
        assert got == expected[mesh_name], (names, shape, mesh_name, got)


# --- trees --------------------------------------------------------------------------------------


LINEN_PARAMS = {"params": {
    "attn": {"q": {"kernel": SDS((64, 8, 16), jnp.float32)},
             "o": {"kernel": SDS((8, 16, 64), jnp.float32)}},
    "mlp": {"up": {"kernel": SDS((64, 256), jnp.float32)}},
    "norm": {"scale": SDS((64,), jnp.float32)},
}}
LINEN_RULES = [
    (r"attn/(q|k|v)/kernel", ("embed", "heads", "head_dim")),
    (r"attn/o/kernel", ("heads", "head_dim", "embed")),
    (r"mlp/up/kernel", ("embed", "mlp")),
    (r"kernel", ("mlp", "embed")),  # never reached for the kernels above: first match wins
]


def test_path_rules_on_linen_dict(meshes):
    specs = rules.specs_for(LINEN_PARAMS, meshes["d2f2t2"], path_rules=LINEN_RULES)
    p = specs["params"]
    assert p["attn"]["q"]["kernel"] == P("fsdp", "tensor")
    assert p["attn"]["o"]["kernel"] == P("tensor", None, "fsdp")
    assert p["mlp"]["up"]["kernel"] == P("fsdp", "tensor")
    assert p["norm"]["scale"] == P()  # no rule matched: replicated
    names = rules.logical_names(LINEN_PARAMS, path_rules=LINEN_RULES)
    assert names["params"]["mlp"]["up"]["kernel"] == ("embed", "mlp")
    assert names["params"]["norm"]["scale"] is None
    shard = rules.shardings_for(LINEN_PARAMS, meshes["d2f2t2"], path_rules=LINEN_RULES)
    want = NamedSharding(meshes["d2f2t2"], P("fsdp", "tensor"))
    assert shard["params"]["attn"]["q"]["kernel"] == want


def test_path_rules_reach_optax_state_and_skip_scalars(meshes):
    params = {"mlp": {"up": {"kernel": jnp.zeros((64, 256))}}}
    opt_state = optax.adam(1e-3).init(params)
    path_rules = [(r"up/kernel", ("embed", "mlp")), (r"count", ("batch",))]
    specs = rules.specs_for(opt_state, meshes["fsdp8"], path_rules=path_rules)
    assert specs[0].mu["mlp"]["up"]["kernel"] == P("fsdp")
    assert specs[0].nu["mlp"]["up"]["kernel"] == P("fsdp")
    assert specs[0].count == P()  # scalar: replicated even though a path rule matched


def test_linen_boxed_names(meshes):
    tree = {"w": nn.LogicallyPartitioned(jnp.zeros((64, 256)), ("embed", "mlp"))}
    specs = rules.specs_for(tree, meshes["d2f2t2"])
    assert specs == {"w": P("fsdp", "tensor")}


class Block(nnx.Module):
    def __init__(self, d: int, f: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Param(init(rngs.params(), (d, f)), out_sharding=("embed", "mlp"),
                            eager_sharding=False)
        self.down = nnx.Param(init(rngs.params(), (f, d)), out_sharding=("mlp", "embed"),
                              eager_sharding=False)


class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d: int = 16, f: int = 64, vocab: int = 32):
        self.embed = nnx.Param(jnp.zeros((vocab, d)), out_sharding=("vocab", "embed"),
                               eager_sharding=False)
        self.layers = nnx.List([Block(d, f, rngs) for _ in range(2)])
        self.scale = nnx.Param(jnp.ones((d,)))  # deliberately unnamed


def test_nnx_module_and_abstract_state(meshes):
    mesh = meshes["d2f2t2"]
    model = Tiny(nnx.Rngs(0))
    abstract = nnx.eval_shape(lambda: Tiny(nnx.Rngs(0)))
    from_module = rules.specs_for(model, mesh)
    from_state = rules.specs_for(nnx.state(model), mesh)
    from_abstract = rules.specs_for(nnx.state(abstract), mesh)
    assert from_module == from_state == from_abstract
    assert from_module["embed"] == P("tensor", "fsdp")
    assert from_module["layers"][0]["up"] == P("fsdp", "tensor")
    assert from_module["layers"][1]["down"] == P("tensor", "fsdp")
    assert from_module["scale"] == P()
    paths = [a.path for a in rules.lint(abstract, mesh).arrays]
    assert "layers/1/down" in paths and not any(p.endswith("value") for p in paths)
    names = rules.logical_names(model)
    assert names["layers"][0]["up"] == ("embed", "mlp") and names["scale"] is None


def test_path_rule_beats_metadata(meshes):
    model = nnx.eval_shape(lambda: Tiny(nnx.Rngs(0)))
    override = [(r"layers/\d+/up$", ("mlp", "embed"))]
    specs = rules.specs_for(model, meshes["tensor8"], path_rules=override)
    assert specs["layers"][0]["up"] == P("tensor")  # the override, not metadata's P(None, "tensor")
    assert specs["layers"][0]["down"] == P("tensor")  # metadata still used elsewhere


def test_shardings_usable_as_jit_out_shardings(meshes):
    mesh = meshes["d2f2t2"]
    abstract = nnx.state(nnx.eval_shape(lambda: Tiny(nnx.Rngs(0))))
    shardings = rules.shardings_for(abstract, mesh)
    specs = rules.specs_for(abstract, mesh)

    state = jax.jit(lambda: nnx.state(Tiny(nnx.Rngs(0))), out_shardings=shardings)()
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    got = jax.tree.leaves(state, is_leaf=is_var)
    want = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(got) == len(want) == 6
    for var, s in zip(got, want):
        arr = var.get_value()
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, s), arr.ndim), (arr.sharding, s)
    assert got[0].get_value().sharding.spec == P("tensor", "fsdp")  # embed really is split


# --- errors -------------------------------------------------------------------------------------


def test_rank_mismatch_names_path_names_and_shape(meshes):
    tree = {"blk": {"bias": SDS((64,), jnp.float32)}}
    with pytest.raises(ValueError) as e:
        rules.specs_for(tree, meshes["fsdp8"], path_rules=[(r"bias", ("embed", "mlp"))])
    msg = str(e.value)
    assert "blk/bias" in msg and "('embed', 'mlp')" in msg and "(64,)" in msg

    class Bad(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((4,)), out_sharding=("embed", "mlp"),
                               eager_sharding=False)

    with pytest.raises(ValueError, match=r"w: logical names \('embed', 'mlp'\).*\(4,\)"):
        rules.specs_for(Bad(), meshes["fsdp8"])
    with pytest.raises(ValueError, match="rank"):
        rules.logical_spec(("batch", None, None), (2, 3), meshes["fsdp8"])


def test_fewer_names_than_dims_pad_with_none(meshes):
    """As in Flax and JAX, a short spec replicates the trailing dims; lint says so."""
    class Attn(nnx.Module):
        def __init__(self):
            self.q = nnx.Param(jnp.zeros((64, 8, 16)), out_sharding=("embed", "heads"),
                               eager_sharding=False)

    m = Attn()
    assert rules.specs_for(m, meshes["d2f2t2"])["q"] == P("fsdp", "tensor")
    assert rules.logical_names(m)["q"] == ("embed", "heads", None)
    assert rules.logical_spec(("batch",), (8, 3), meshes["data8"]) == P("data")
    report = rules.lint(m, meshes["d2f2t2"])
    assert report.partial == [("q", 2, 3)] and "2 of 3 dims" in str(report)


def test_mesh_axis_names_mean_those_axes(meshes):
    """Flax examples annotate with mesh-axis names directly; with no rule of their own they mean
    that axis (what Flax does), instead of being unknown and replicated."""
    class Net(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((64, 256)), out_sharding=("fsdp", "tensor"),
                               eager_sharding=False)

    assert rules.specs_for(Net(), meshes["d2f2t2"])["w"] == P("fsdp", "tensor")
    assert rules.specs_for(Net(), meshes["fsdp8"])["w"] == P("fsdp")
    report = rules.lint(Net(), meshes["fsdp8"])
    assert report.ratio == pytest.approx(1.0) and report.unknown_names == []
    # a rule of the same name wins over the mesh-axis meaning
    assert rules.specs_for(Net(), meshes["fsdp8"], rules=[("fsdp", None)])["w"] == P()


def test_bad_rules_rejected(meshes):
    with pytest.raises(ValueError, match="rule"):
        rules.logical_spec(("x",), (8,), meshes["fsdp8"], [("x", 3)])


# --- lint ---------------------------------------------------------------------------------------


def test_lint_report(meshes):
    mesh = meshes["d2f2t2"]
    tree = {
        "up": SDS((64, 256), jnp.float32),     # named by path rule: split 4 ways
        "loose": SDS((100, 10), jnp.float32),  # no names: replicated
        "moe": SDS((16, 64), jnp.float32),     # "experts" is a name no rule knows
        "odd": SDS((3, 64), jnp.float32),      # 3 kv heads: tensor=2 does not divide them
    }
    path_rules = [(r"^up$", ("embed", "mlp")), (r"moe", ("experts", "embed")),
                  (r"odd", ("kv_heads", "embed"))]
    my_rules = rules.DEFAULT_RULES + (("mlp", "data"),)
    report = rules.lint(tree, mesh, rules=my_rules, path_rules=path_rules)

    total = 4 * (64 * 256 + 100 * 10 + 16 * 64 + 3 * 64)
    assert report.total_bytes == total
    per_dev = 4 * (64 * 256 // 4 + 100 * 10 + 16 * 64 // 2 + 3 * 64 // 2)
    assert report.per_device_bytes == per_dev
    assert report.ideal_bytes == total / 8
    assert report.ratio == pytest.approx(per_dev / (total / 8))
    assert report.replicated == [("loose", 4000)] and report.replicated_bytes == 4000
    assert report.unknown_names == ["experts"]
    unused = {(u.logical, u.axes): u.reason for u in report.unused_rules}
    assert "shadowed" in unused[("mlp", "data")]       # mlp always took tensor first
    assert "no usable" in unused[("kv_heads", "tensor")]  # 3 heads: tensor=2 does not divide
    assert "no usable" in unused[("kv_heads", "fsdp")]  # fsdp already taken by embed
    assert unused[("norm", "fsdp")] == "name not in tree"
    assert ("embed", "fsdp") not in unused
    # kv_heads -> fsdp is then skipped silently: embed already took fsdp (not a divisibility issue)
    assert report.fallbacks == [Fallback("odd", 0, "kv_heads", "tensor", 2, 3)]

    text = str(report)
    for needle in ("Replicated arrays", "loose", "Divisibility fallbacks", "Rules that never fired",
                   "experts", "per-device bytes", "P('fsdp', 'tensor')"):
        assert needle in text, needle
    d = json.loads(json.dumps(report.to_dict()))
    assert d["replicated"] == [{"path": "loose", "bytes": 4000}]
    assert d["total_bytes"] == total
    assert isinstance(report, rules.LintReport)


def test_lint_balanced_on_fsdp(meshes):
    tree = {"w": SDS((64, 256), jnp.float32)}
    report = rules.lint(tree, meshes["fsdp8"], path_rules=[(r"w", ("embed", "mlp"))])
    assert report.ratio == 1.0 and report.replicated == [] and report.fallbacks == []


# --- activations --------------------------------------------------------------------------------


def test_constrain_identity_without_context():
    x = jnp.ones((8, 16))
    assert rules.constrain(x, ("batch", "act_mlp")) is x
    f = jax.jit(lambda x: rules.constrain(x, ("batch", "act_mlp")))
    assert "sharding_constraint" not in f.lower(x).as_text()


def test_constrain_in_jit_and_scan(meshes):
    mesh = meshes["d2f2t2"]

    def step(x):
        x = rules.constrain(x, ("batch", "act_embed"))

        def body(c, _):
            return rules.constrain(c * 2.0, ("batch", "act_mlp")), None

        return jax.lax.scan(body, x, None, length=3)[0]

    x = jnp.ones((8, 16))
    with rules.activation_sharding(mesh):
        f = jax.jit(step)
        text = f.lower(x).as_text()
        out = f(x)
    assert text.count("sharding_constraint") + text.count("@Sharding") >= 2
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), "tensor")), 2)
    np.testing.assert_allclose(np.asarray(out), 8.0)
    assert rules.constrain(x, ("batch",)) is x  # context is gone after the block


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3), (6, 3)])
def test_local_runs_an_op_on_local_arrays_inside_a_partial_shard_map(meshes, heads, kv_heads):
    """``sharding.activations.local`` (what runs cuDNN's attention inside the pipeline's and the
    gradient reducer's shard_maps) splits each array by its logical names over the axes still
    automatic and gives the op local arrays: same values and gradients as the plain call, at
    the top level and nested in a shard_map over ``data`` (grouped-query attention, float32);
    also where heads or kv heads do not divide over tensor 2 (those arrays replicated there:
    the varying-axes check keeps their gradients from being summed over tensor; kv heads 3
    under query heads split 2 ways are repeated first: without, the local call paired local
    query head i with kv head i, 62 % of the gradients wrong)."""
    from functools import partial

    from jaxmp.models.attention import attend_locally

    mesh = meshes["d2f2t2"]
    attn = partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (8, 16, heads, 8))
    k, v = (jax.random.normal(key, (8, 16, kv_heads, 8)) for key in keys[1:])

    def loss(q, k, v, wrapped):
        out = attend_locally(attn, q, k, v) if wrapped else attn(q, k, v)
        return jnp.sum(out * jnp.cos(out))

    def per_replica(q, k, v):
        with rules.activation_sharding(mesh):
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v, True)

    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, False)
    with rules.activation_sharding(mesh):
        top = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, True)
    nested = jax.jit(jax.shard_map(per_replica, mesh=mesh, in_specs=P("data"),
                                   out_specs=P("data"), axis_names={"data"},
                                   check_vma=False))(q, k, v)
    for got in (top, nested):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_lint_finds_a_split_out_bias_in_a_stacked_attention():
    """nnx.vmap-stacked nnx.MultiHeadAttention (leading "layers" dim) with its one bias_init
    named "kv": the out bias ([layers, embed]) is split over tensor on dim 1 while the out
    kernel's embed dim is not; the q/k/v biases match their kernels and are not flagged."""
    xavier, zeros = nnx.initializers.xavier_uniform(), nnx.initializers.zeros_init()

    def make():
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(r):
            return nnx.MultiHeadAttention(
                4, 64, decode=False, kernel_init=nnx.with_partitioning(xavier, ("embed", "kv")),
                out_kernel_init=nnx.with_partitioning(xavier, ("kv", None, "embed")),
                bias_init=nnx.with_partitioning(zeros, ("kv",)), rngs=r)
        return stack(nnx.Rngs(0))

    report = rules.lint(rules.abstract(make), jaxmp.make_mesh({"fsdp": 2, "tensor": 4}),
                        rules=[("kv", "tensor"), *rules.DEFAULT_RULES])
    assert [(b.path, b.dim, b.mesh_axes) for b in report.split_biases] == [
        ("out/bias", 1, ("tensor",))]
    assert report.warning().startswith("out/bias is split over tensor on dim 1 by rule")
