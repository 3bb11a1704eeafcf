"""jaxmp.hlo: collective bytes parsed from HLO text, checked on hand-written and real compiled programs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmp.hlo import collective_stats, shape_bytes


# ---------------------------------------------------------------- shape_bytes

@pytest.mark.parametrize("text, expected", [
    ("f32[]", 4),
    ("pred[]", 1),
    ("f32[8,128]{1,0}", 8 * 128 * 4),
    ("bf16[4,4]", 32),
    ("f16[3]{0}", 6),
    ("s8[10]", 10),
    ("u16[2,2]", 8),
    ("f64[2]", 16),
    ("s64[3]", 24),
    ("(f32[2], bf16[4,4])", 8 + 32),
    ("(s32[], f32[1024]{0})", 4 + 4096),
    ("(f32[128]{0}, /*index=5*/f32[128]{0})", 1024),
    ("f32[8,128]{1,0:T(8,128)}", 4096),
    ("f8e4m3fn[16]", 16),
    ("s4[3]", 2),
    ("(f32[4], u32[], token[])", 20),
])
def test_shape_bytes(text, expected):
    assert shape_bytes(text) == expected


def test_shape_bytes_rejects_unknown_dtype():
    with pytest.raises(ValueError):
        shape_bytes("q7[4]")


# ---------------------------------------------------------------- hand-written HLO

def _module(body: str, header: str = "num_partitions=8", extra: str = "") -> str:
    return f"""HloModule m, {header}

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}
{extra}
ENTRY %main (p: f32[1024], q: f32[256]) -> f32[1024] {{
  %p = f32[1024]{{0}} parameter(0)
  %q = f32[256]{{0}} parameter(1)
{body}
}}
"""


@pytest.mark.parametrize("groups, n", [
    ("{{0,1,2,3},{4,5,6,7}}", 4),
    ("{{0,1,2,3,4,5,6,7}}", 8),
    ("{{0},{1},{2},{3},{4},{5},{6},{7}}", 1),
    ("[2,4]<=[8]", 4),
    ("[4,2]<=[2,4]T(1,0)", 2),
    ("{}", 8),
    ("mesh['x'=4,'y'=2], device_ids=([2,4]T(1,0)) {'x'}", 4),
    ("mesh['x'=2,'y'=4] {'x','y'}", 8),
    ("mesh['x'=8] {'x':(2)2}", 2),
])
def test_replica_group_forms(groups, n):
    text = _module(f"  ROOT %r = f32[1024]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, "
                   "use_global_device_ids=true, to_apply=%add")
    (op,) = collective_stats(text).ops
    assert op.group_size == n
    assert op.sent_bytes == pytest.approx(2 * (n - 1) / n * 4096)


def test_empty_groups_use_argument_then_header_then_warn():
    line = "  ROOT %r = f32[1024]{0} all-reduce(%p), replica_groups={}, to_apply=%add"
    assert collective_stats(_module(line), num_devices=4).ops[0].group_size == 4
    assert collective_stats(_module(line, "num_partitions=2, replica_count=2")).ops[0].group_size == 4
    stats = collective_stats(_module(line, "is_scheduled=true"))
    assert stats.ops[0].group_size == 1 and stats.warnings


def test_async_all_to_all_counts_its_result_not_the_operand_tuple():
    # GPU all-to-all-start returns ((operands), result): one buffer is sent, not two.
    body = """  %s = ((bf16[2,2048,8,128]{3,1,0,2}), bf16[2,2048,8,128]{3,1,0,2}) all-to-all-start(%p), channel_id=4, replica_groups=[1,8]<=[8], dimensions={2}
  ROOT %d = bf16[2,2048,8,128]{3,1,0,2} all-to-all-done(%s)"""
    stats = collective_stats(_module(body))
    assert stats.bytes_by_kind["all-to-all"] == pytest.approx(7 / 8 * 2 * 2048 * 8 * 128 * 2)


def test_each_kind_and_formula():
    body = """  %ar = (f32[10]{0}, f32[20]{0}) all-reduce(%p, %q), replica_groups=[1,8]<=[8], to_apply=%add
  %ag = f32[8192]{0} all-gather(%p), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
  %rs = f32[128]{0} reduce-scatter(%p), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %a2a = f32[1024]{0} all-to-all(%p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  ROOT %cp = f32[256]{0} collective-permute(%q), channel_id=5, source_target_pairs={{0,1},{1,0}}"""
    stats = collective_stats(_module(body))
    b = stats.bytes_by_kind
    assert b["all-reduce"] == pytest.approx(2 * 7 / 8 * 120)  # tuple shapes are summed
    assert b["all-gather"] == pytest.approx(7 / 8 * 32768)    # S_out
    assert b["reduce-scatter"] == pytest.approx(3 / 4 * 4096)  # S_in, from the operand's shape
    assert b["all-to-all"] == pytest.approx(1 / 2 * 4096)
    assert b["collective-permute"] == 1024
    assert stats.total_bytes == pytest.approx(sum(b.values()))
    assert all(c == 1 for c in stats.count_by_kind.values())
    assert "reduce-scatter" in stats.summary() and "total" in stats.summary()


def test_inline_operand_shapes_and_garbage():
    body = ("  ROOT %rs = f32[128]{0} reduce-scatter(f32[1024]{0} %not_defined_here), "
            "replica_groups=[1,8]<=[8], to_apply=%add")
    assert collective_stats(_module(body)).ops[0].bytes == 4096
    stats = collective_stats("not HLO at all")
    assert stats.total_bytes == 0 and stats.warnings


def test_a_combined_permute_sends_every_operand():
    """XLA's GPU compiler combines the pipeline's two sends per tick (activation and
    cotangent) into one collective-permute-start of a tuple: both are sent (the count used to
    take the first operand only, half the pipelined steps' stage bytes)."""
    body = """  %cps = ((f32[256]{0}, f32[1024]{0}), (f32[256]{0}, f32[1024]{0})) collective-permute-start(%q, %p), source_target_pairs={{0,1},{1,0}}
  ROOT %cpd = (f32[256]{0}, f32[1024]{0}) collective-permute-done(%cps)"""
    assert collective_stats(_module(body)).bytes_by_kind["collective-permute"] == 1024 + 4096


def test_async_start_done_counted_once():
    body = """  %ars = f32[1024]{0} all-reduce-start(%p), replica_groups=[1,8]<=[8], to_apply=%add
  %ard = f32[1024]{0} all-reduce-done(%ars)
  %ags = (f32[256]{0}, f32[2048]{0}) all-gather-start(%q), replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[2048]{0} all-gather-done(%ags)
  %cps = (f32[256]{0}, f32[256]{0}, u32[], u32[]) collective-permute-start(%q), source_target_pairs={{0,1}}
  %cpd = f32[256]{0} collective-permute-done(%cps)
  %as = ((f32[1024]{0}), f32[1024]{0}, s32[]) async-start(%p), calls=%wrapped_a2a
  ROOT %ad = f32[1024]{0} async-done(%as), calls=%wrapped_a2a"""
    extra = """
%wrapped_a2a (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %a = f32[1024]{0} all-to-all(%x), replica_groups=[1,8]<=[8], dimensions={0}
}
"""
    stats = collective_stats(_module(body, extra=extra))
    assert stats.count_by_kind == {"all-reduce": 1, "all-gather": 1, "reduce-scatter": 0,
                                   "all-to-all": 1, "collective-permute": 1}
    b = stats.bytes_by_kind
    assert b["all-reduce"] == pytest.approx(2 * 7 / 8 * 4096)
    assert b["all-gather"] == pytest.approx(7 / 8 * 8192)
    assert b["collective-permute"] == 1024
    assert b["all-to-all"] == pytest.approx(7 / 8 * 4096)


_LOOP = """
%cond{i} (c{i}: (s32[], f32[1024])) -> pred[] {{
  %c{i} = (s32[], f32[1024]{{0}}) parameter(0)
  %ci{i} = s32[] get-tuple-element(%c{i}), index=0
  %lim{i} = s32[] constant({limit})
  ROOT %lt{i} = pred[] compare({lhs}), direction={direction}
}}

%body{i} (b{i}: (s32[], f32[1024])) -> (s32[], f32[1024]) {{
  %b{i} = (s32[], f32[1024]{{0}}) parameter(0)
  %bi{i} = s32[] get-tuple-element(%b{i}), index=0
  %bx{i} = f32[1024]{{0}} get-tuple-element(%b{i}), index=1
  %one{i} = s32[] constant({step})
  %next{i} = s32[] add(%bi{i}, %one{i})
  {inner}
  ROOT %t{i} = (s32[], f32[1024]{{0}}) tuple(%next{i}, %r{i})
}}
"""
_AR = "%r{i} = f32[1024]{{0}} all-reduce(%bx{i}), replica_groups=[1,8]<=[8], to_apply=%add"


def _loop(i: int, limit: int, step: int = 1, direction: str = "LT", swap: bool = False,
          inner: str | None = None) -> str:
    lhs = f"%lim{i}, %ci{i}" if swap else f"%ci{i}, %lim{i}"
    return _LOOP.format(i=i, limit=limit, step=step, direction=direction, lhs=lhs,
                        inner=inner or _AR.format(i=i))


def _while(i: int, init: int = 0, config: str = "") -> str:
    return f"""  %z = s32[] constant({init})
  %init = (s32[], f32[1024]{{0}}) tuple(%z, %p)
  %w = (s32[], f32[1024]{{0}}) while(%init), condition=%cond{i}, body=%body{i}{config}
  ROOT %out = f32[1024]{{0}} get-tuple-element(%w), index=1"""


def test_while_known_trip_count():
    cfg = ', backend_config={"known_trip_count":{"n":"7"}}'
    stats = collective_stats(_module(_while(0, config=cfg), extra=_loop(0, limit=99)))
    assert stats.count_by_kind["all-reduce"] == 7 and stats.ops[0].multiplier == 7
    assert stats.bytes_by_kind["all-reduce"] == pytest.approx(7 * 2 * 7 / 8 * 4096)
    assert not stats.warnings


@pytest.mark.parametrize("init, limit, step, direction, swap, trips", [
    (0, 5, 1, "LT", False, 5),
    (2, 5, 1, "LT", False, 3),
    (0, 10, 3, "LT", False, 4),
    (0, 5, 1, "LE", False, 6),
    (0, 5, 1, "GT", True, 5),    # 5 > i
    (10, 0, -2, "GT", False, 5),  # counting down
])
def test_while_trip_count_from_condition(init, limit, step, direction, swap, trips):
    text = _module(_while(0, init=init), extra=_loop(0, limit, step, direction, swap))
    stats = collective_stats(text)
    assert stats.count_by_kind["all-reduce"] == trips
    assert not stats.warnings


def test_nested_while_multiplies():
    inner_while = """%zi = s32[] constant(0)
  %ii = (s32[], f32[1024]{0}) tuple(%zi, %bx0)
  %wi = (s32[], f32[1024]{0}) while(%ii), condition=%cond1, body=%body1
  %r0 = f32[1024]{0} get-tuple-element(%wi), index=1"""
    extra = _loop(0, limit=3, inner=inner_while) + _loop(1, limit=4)
    stats = collective_stats(_module(_while(0), extra=extra))
    assert stats.ops[0].multiplier == 12 and stats.ops[0].computation == "body1"
    assert stats.count_by_kind["all-reduce"] == 12


def test_unknown_trip_count_counts_once_and_warns():
    loop = _loop(0, limit=5).replace("%lim0 = s32[] constant(5)", "%lim0 = s32[] get-tuple-element(%c0), index=0")
    stats = collective_stats(_module(_while(0), extra=loop))
    assert stats.count_by_kind["all-reduce"] == 1
    assert any("trip count" in w for w in stats.warnings)


def test_call_and_conditional_edges():
    extra = """
%callee (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %a = f32[1024]{0} all-reduce(%x), replica_groups=[1,8]<=[8], to_apply=%add
}

%other (y: f32[1024]) -> f32[1024] {
  ROOT %y = f32[1024]{0} parameter(0)
}
"""
    body = """  %k = f32[1024]{0} call(%p), to_apply=%callee
  %pred = s32[] constant(0)
  ROOT %cnd = f32[1024]{0} conditional(%pred, %k, %p), branch_computations={%callee, %other}"""
    stats = collective_stats(_module(body, extra=extra))
    assert stats.count_by_kind["all-reduce"] == 2  # via call, and via the (upper-bound) branch
    assert [w for w in stats.warnings if "conditional" in w] == ["a: under a conditional, counted as if it ran"]


def test_tuple_parts():
    from jaxmp.hlo.collectives import tuple_parts

    assert tuple_parts("((bf16[8]{0}, f32[2]), bf16[8]{0})") == ["(bf16[8]{0}, f32[2])", "bf16[8]{0}"]
    assert tuple_parts("(f32[2], /*index=5*/bf16[4,4]{1,0})") == ["f32[2]", "bf16[4,4]{1,0}"]
    assert tuple_parts("f32[3]{0}") == ["f32[3]{0}"]


def test_jax_012_all_reduce_start_returns_operands_and_result():
    """jax 0.12's async all-reduce is ``((operands), result)``: sized once, not twice, and the
    mesh-axes replica groups of both versions give the group size."""
    old = """  %ars = bf16[1024]{0} all-reduce-start(%p), replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}, to_apply=%add
  ROOT %ard = bf16[1024]{0} all-reduce-done(%ars)"""
    new = """  %ars = ((bf16[1024]{0}), bf16[1024]{0}) all-reduce-start(%p), replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}, to_apply=%add
  ROOT %ard = bf16[1024]{0} all-reduce-done(%ars)"""
    for body in (old, new):
        (op,) = collective_stats(_module(body)).ops
        assert (op.group_size, op.bytes) == (4, 2048)


# ---------------------------------------------------------------- overlap in a scheduled program

_SCHEDULED = """
%gemm (x: f32[1024], y: f32[1024]) -> f32[] {
  %x = f32[1024]{0} parameter(0)
  %y = f32[1024]{0} parameter(1)
  ROOT %d = f32[] dot(%x, %y), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}

%scale (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %m = f32[1024]{0} multiply(%x, %x)
}
"""


def test_overlap_needs_a_matmul_between_start_and_done():
    """An async pair with a matmul (here a fusion calling a dot) scheduled between start and
    done is overlapped; with only an elementwise fusion, or nothing, it is exposed; a done
    that never follows its start (pipelined into the next iteration) is overlapped; a plain
    collective is synchronous."""
    from jaxmp.hlo import collective_overlap

    body = """  %ags = (f32[128]{0}, f32[1024]{0}) all-gather-start(%q), replica_groups=[1,8]<=[8], dimensions={0}
  %f = f32[] fusion(%p, %p), kind=kCustom, calls=%gemm
  %agd = f32[1024]{0} all-gather-done(%ags)
  %rss = f32[128]{0} reduce-scatter-start(%p), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %e = f32[1024]{0} fusion(%p), kind=kLoop, calls=%scale
  %rsd = f32[128]{0} reduce-scatter-done(%rss)
  %ars = f32[1024]{0} all-reduce-start(%p), replica_groups=[1,8]<=[8], to_apply=%add
  %ard = f32[1024]{0} all-reduce-done(%ars)
  %ar = f32[1024]{0} all-reduce(%p), replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %cps = (f32[256]{0}, f32[256]{0}, u32[], u32[]) collective-permute-start(%q), source_target_pairs={{0,1}}"""
    rows = collective_overlap(_module(body, extra=_SCHEDULED)).by_kind()
    assert (rows["all-gather"]["overlapped"], rows["all-gather"]["exposed"]) == (1, 0)
    assert rows["reduce-scatter"]["exposed"] == rows["reduce-scatter"]["exposed_beside_compute"] == 1
    assert rows["all-reduce"] == {"bytes": pytest.approx(2 * 2 * 7 / 8 * 4096), "async": 1,
                                  "overlapped": 0, "exposed": 1, "exposed_beside_compute": 0,
                                  "sync": 1}
    assert rows["collective-permute"]["overlapped"] == 1  # its done is in the next iteration


def test_overlap_finds_all_gathers_in_a_loop_body():
    from jaxmp.hlo import collective_overlap

    inner = """%ags0 = (f32[128]{0}, f32[1024]{0}) all-gather-start(%bx0), replica_groups=[1,8]<=[8], dimensions={0}
  %r0 = f32[1024]{0} all-gather-done(%ags0)"""
    stats = collective_overlap(_module(_while(0), extra=_loop(0, limit=4, inner=inner)))
    (ag,) = stats.loop_all_gathers
    assert ag.in_loop and ag.computation == "body0" and not ag.overlapped
    assert stats.exposed_loop_all_gathers == 1
    # 4 trips of S = result minus operand bytes (4608 - 4096 here)
    assert stats.bytes_by_kind["all-gather"] == pytest.approx(4 * 7 / 8 * 512)
    assert "all-gathers in a loop body: 1, exposed 1" in stats.summary()


# ---------------------------------------------------------------- real programs on 8 CPU devices

@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def _shard_map(f, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def test_real_psum(mesh):
    f = _shard_map(lambda v: jax.lax.psum(v, "x"), mesh, P("x"), P())
    lowered = f.lower(jnp.ones(8 * 1024, jnp.float32))
    for source in (lowered, lowered.compile(), lowered.compile().as_text()):
        stats = collective_stats(source)
        assert stats.count_by_kind["all-reduce"] == 1 and stats.ops[0].group_size == 8
        assert stats.bytes_by_kind["all-reduce"] == pytest.approx(2 * 7 / 8 * 4096)
        assert stats.total_bytes == stats.bytes_by_kind["all-reduce"]


def test_real_all_gather(mesh):
    f = _shard_map(lambda v: jax.lax.all_gather(v, "x", tiled=True), mesh, P("x"), P())
    stats = collective_stats(f.lower(jnp.ones(8 * 1024, jnp.float32)))
    assert stats.count_by_kind["all-gather"] == 1 and stats.total_bytes == 7 / 8 * 8 * 4096


def test_real_psum_scatter(mesh):
    # the CPU backend keeps a real reduce-scatter here (no all-reduce + dynamic-slice)
    f = _shard_map(lambda v: jax.lax.psum_scatter(v, "x", tiled=True), mesh, P(), P("x"))
    stats = collective_stats(f.lower(jnp.ones(8 * 1024, jnp.float32)))
    assert stats.count_by_kind["reduce-scatter"] == 1 and stats.total_bytes == 7 / 8 * 8 * 4096


def test_real_ppermute_and_all_to_all(mesh):
    ring = [(i, (i + 1) % 8) for i in range(8)]
    f = _shard_map(lambda v: jax.lax.ppermute(v, "x", ring), mesh, P("x"), P("x"))
    assert collective_stats(f.lower(jnp.ones(8 * 1024))).bytes_by_kind["collective-permute"] == 4096
    g = _shard_map(lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True), mesh, P("x"), P("x"))
    stats = collective_stats(g.lower(jnp.ones(8 * 1024)))  # CPU: one all-to-all over a tuple of 8 slices
    assert stats.count_by_kind["all-to-all"] == 1 and stats.total_bytes == 7 / 8 * 4096


@pytest.mark.parametrize("loop", ["fori", "scan"])
def test_real_psum_in_loop_counts_trips(mesh, loop):
    def body(v):
        if loop == "fori":
            return jax.lax.fori_loop(0, 5, lambda i, c: jax.lax.psum(c, "x") * 0.5, v)
        return jax.lax.scan(lambda c, _: (jax.lax.psum(c, "x") * 0.5, None), v, None, length=5)[0]

    compiled = _shard_map(body, mesh, P("x"), P("x")).lower(jnp.ones(8 * 1024, jnp.float32)).compile()
    text = compiled.as_text()
    assert " while(" in text and "known_trip_count" in text  # CPU keeps the loop rolled
    stats = collective_stats(compiled)
    assert stats.count_by_kind["all-reduce"] == 5 and stats.ops[0].multiplier == 5
    assert stats.bytes_by_kind["all-reduce"] == pytest.approx(5 * 2 * 7 / 8 * 4096)
    # the same answer without backend_config: derived from the loop condition
    stripped = text.replace('"known_trip_count":{"n":"5"}', '"x":1')
    assert "known_trip_count" not in stripped
    derived = collective_stats(stripped)
    assert derived.count_by_kind["all-reduce"] == 5 and not derived.warnings


def test_real_jit_psum_over_one_axis_of_2x4_mesh():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    f = jax.jit(lambda y: y.sum(axis=0), in_shardings=NamedSharding(mesh, P("b", "a")),
                out_shardings=NamedSharding(mesh, P()))
    stats = collective_stats(f.lower(jnp.ones((8, 1024), jnp.float32)))
    # a 4-way all-reduce over "b" of the f32[512] partial sums, then a 2-way all-gather over "a"
    (ar,) = [op for op in stats.ops if op.kind == "all-reduce"]
    assert ar.group_size == 4 and ar.bytes == 2048
    assert stats.bytes_by_kind["all-reduce"] == pytest.approx(2 * 3 / 4 * 2048)
    assert [op.group_size for op in stats.ops if op.kind == "all-gather"] == [2]


FOLD_HLO = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused (p0: f32[64,16], p1: s32[]) -> f32[8,16] {
  %p0 = f32[64,16]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[8,16]{1,0} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={8,16}
}

ENTRY %main (x: f32[64,16], y: f32[32]) -> (f32[8,16], f32[32]) {
  %x = f32[64,16]{1,0} parameter(0)
  %y = f32[32]{0} parameter(1)
  %ar = (f32[64,16]{1,0}, f32[32]{0}) all-reduce(%x, %y), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %g0 = f32[64,16]{1,0} get-tuple-element(%ar), index=0
  %g1 = f32[32]{0} get-tuple-element(%ar), index=1
  %pid = u32[] partition-id()
  %off = s32[] convert(%pid)
  %f = f32[8,16]{1,0} fusion(%g0, %off), kind=kLoop, calls=%fused
  ROOT %t = (f32[8,16]{1,0}, f32[32]{0}) tuple(%f, %g1)
}
"""


def test_all_reduce_then_slice_folds_into_reduce_scatter():
    """The sliced tuple element counts as a reduce-scatter; the element used whole does not."""
    folded = collective_stats(FOLD_HLO)
    assert folded.bytes_by_kind["reduce-scatter"] == pytest.approx(7 / 8 * 64 * 16 * 4)
    assert folded.bytes_by_kind["all-reduce"] == pytest.approx(2 * 7 / 8 * 32 * 4)
    raw = collective_stats(FOLD_HLO, fold_reduce_scatter=False)
    assert raw.bytes_by_kind["reduce-scatter"] == 0
    assert raw.total_bytes == pytest.approx(2 * 7 / 8 * (64 * 16 + 32) * 4)
    assert folded.raw_total_bytes == pytest.approx(raw.total_bytes)
