"""jaxmp._util.env: process settings that must be made before JAX starts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_malloc_arenas_are_capped_unless_the_user_chose():
    """jaxmp train caps glibc's arenas (long runs' host RSS stays flat); a MALLOC_ARENA_MAX the
    user set wins. Run in fresh interpreters: the setting is process-wide."""
    code = "from jaxmp._util.env import limit_malloc_arenas as f; print(f())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    capped = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, check=True).stdout.strip()
    chosen = subprocess.run([sys.executable, "-c", code], env={**env, "MALLOC_ARENA_MAX": "4"},
                            capture_output=True, text=True, check=True).stdout.strip()
    assert (capped, chosen) == ("True", "False")


# ------------------------------------------------------------------ the platform, before JAX

from jaxmp._util import env  # noqa: E402 - stdlib only, like the tests above

NO_GPU = (False, "the CUDA driver sees no GPU")


def test_platform_rule():
    """CPU when the CUDA plugin has no GPU to use (with one line saying why); JAX's own choice
    with a usable GPU or without the plugin; a JAX_PLATFORMS the user set always wins (and
    then nothing is probed)."""
    never = lambda: pytest.fail("probed although the answer was already known")  # noqa: E731
    assert env.platform_decision("", lambda: True, lambda: NO_GPU) == (
        True, "jaxmp: running on the CPU: JAX's CUDA plugin is installed but the CUDA driver "
              "sees no GPU")
    assert env.platform_decision("", lambda: True, lambda: (True, "8 GPU(s)")) == (False, None)
    assert env.platform_decision("", lambda: False, never) == (False, None)
    assert env.platform_decision("cuda", never, never) == (False, None)


def test_either_cuda_plugin_counts(monkeypatch):
    """JAX's CUDA 12 and CUDA 13 plugins both count as installed: a GPU image with only
    ``jax[cuda13]`` (the lent H200's) gets the same quiet platform choice and ``--aot``."""
    import importlib.util

    for present in (*env.CUDA_PLUGINS, None):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, present=present: object() if name == present else None)
        assert env.cuda_plugin_installed() is (present is not None)


def test_gpu_probe_answers_without_jax():
    """The probe asks the driver through ctypes: on this machine (no GPU) it says no, with a
    reason, and never raises; jax is not imported by it."""
    code = ("import sys; from jaxmp._util.env import gpu_usable; ok, why = gpu_usable(); "
            "print(ok, bool(why), 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[1:] == ["True", "False"]
    if out[0] == "True":
        pytest.skip("this machine has a usable GPU")


def test_gpu_memory_fraction_is_the_users_when_set(monkeypatch):
    monkeypatch.delenv(env.MEM_FRACTION, raising=False)
    assert env.set_gpu_memory_fraction(0.75) and os.environ[env.MEM_FRACTION] == "0.75"
    monkeypatch.setenv(env.MEM_FRACTION, "0.5")
    assert not env.set_gpu_memory_fraction(0.9) and os.environ[env.MEM_FRACTION] == "0.5"
    monkeypatch.delenv(env.MEM_FRACTION)
    assert not env.set_gpu_memory_fraction(0.0) and env.MEM_FRACTION not in os.environ


def test_train_takes_the_memory_fraction_from_the_device_section():
    from jaxmp.cli.train import gpu_memory_fraction
    from jaxmp.recipes.gpt_config import load_config

    assert gpu_memory_fraction(load_config(None, ["device.usable_fraction=0.9"])) == 0.9
    assert gpu_memory_fraction(load_config(None, ["device.kind=H100"])) == 0.75
    assert gpu_memory_fraction(load_config()) == 0.75  # kind "auto": the GPU profiles' share


@pytest.mark.skipif(not env.cuda_plugin_installed(), reason="JAX's CUDA plugin is not "
                    "installed (pip install -e \".[cuda]\")")
def test_cuda_plugin_without_a_gpu_is_quiet():
    """With the CUDA plugin installed and no GPU, a jaxmp command printed JAX's cuInit
    traceback before working. Now the CLI runs on the CPU and stderr stays clean (at most one
    line). JAX_PLATFORMS, which conftest sets, is removed for the child."""
    if env.gpu_usable()[0]:
        pytest.skip("this machine has a usable GPU")
    child = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, "-m", "jaxmp.cli", "plan", "--top", "0",
                        "--set", "model.layers=1", "--set", "data.seq_len=16"],
                       env=child, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "cuInit" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 1, r.stderr
    assert " x CPU (" in r.stdout.splitlines()[0]  # it ran, on the CPU
    # research scripts settle it the same way (examples/: simulate_devices_from_argv)
    code = ("from jaxmp._util.env import simulate_devices_from_argv as s; s([]); "
            "import jax; print(jax.devices()[0].platform)")
    r = subprocess.run([sys.executable, "-c", code], env=child, capture_output=True, text=True)
    assert r.stdout.strip() == "cpu" and "Traceback" not in r.stderr, r.stderr


def test_gpu_compile_options_order_and_types(monkeypatch):
    """Every GPU compile gets jaxmp's flags, then the config's, then the user's ``XLA_FLAGS``
    (last wins), typed as compile options; two collectives may be in flight (a tensor
    all-reduce must not keep the next layer's fsdp gather waiting: docs/planner.md §7);
    collective pipelining in both jaxlib spellings (jaxlib 0.12's default left the layer
    loop's gathers synchronous: §7 "Stop 29")."""
    from jaxmp._util.env import gpu_compile_options

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_experimental_parallel_collective_overlap_limit=4 "
                                    "--xla_force_host_platform_device_count=8")
    options = gpu_compile_options("--xla_gpu_enable_latency_hiding_scheduler=false")
    assert options["xla_gpu_experimental_parallel_collective_overlap_limit"] == 4
    assert options["xla_gpu_enable_latency_hiding_scheduler"] is False
    assert options["xla_gpu_all_gather_combine_threshold_bytes"] == 2**30
    assert not any(k.startswith("xla_force") for k in options)
    monkeypatch.delenv("XLA_FLAGS")
    ours = gpu_compile_options()
    assert ours["xla_gpu_experimental_parallel_collective_overlap_limit"] == 2
    assert ours["xla_gpu_enable_pipelined_all_gather"] is True  # jaxlib 0.10
    assert ours["xla_gpu_pipeline_all_gather"] == "COLLECTIVE_PIPELINING_MODE_ON"  # jaxlib 0.12
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_pipeline_all_gather=off")  # XLA_FLAGS' spelling
    assert gpu_compile_options()["xla_gpu_pipeline_all_gather"] == "COLLECTIVE_PIPELINING_MODE_OFF"


def test_fsdp_with_accumulating_microbatches_gets_three_collectives_in_flight():
    """The overlap limit is the plan's: 3 where fsdp gathers weights and microbatches
    accumulate (the backward's prefetch no longer waits behind the layer's two gradient
    reduce-scatters: docs/planner.md §7 "Stop 31"), 2 elsewhere (a third slot held one more
    sequence-parallel gather's buffer on the data 2 x tensor 4 case: "Stop 29"); the config's
    flags and ``XLA_FLAGS`` still win, and plan.json says which flags the plan adds."""
    from jaxmp._util.env import FSDP_ACCUMULATION_GPU_FLAGS, gpu_compile_options
    from jaxmp.plan.layout import Layout, mesh_items

    def layout(mb: int, stage: int = 1, **mesh: int) -> Layout:
        sizes = {"data": 1, "stage": stage, "fsdp": 1, "tensor": 1, **mesh}
        return Layout(mesh_items(sizes), "full", mb)

    limit = "xla_gpu_experimental_parallel_collective_overlap_limit"
    assert layout(2, fsdp=4, tensor=2).xla_flags.split()[0] == FSDP_ACCUMULATION_GPU_FLAGS
    for other in (layout(1, fsdp=8), layout(4, data=2, tensor=4), layout(4, 2, fsdp=4)):
        # 1 microbatch, no fsdp, the pipeline takes them
        assert FSDP_ACCUMULATION_GPU_FLAGS not in other.xla_flags
        assert gpu_compile_options("", other.xla_flags)[limit] == 2
    plan_flags = layout(2, fsdp=8).xla_flags
    assert gpu_compile_options("", plan_flags)[limit] == 3
    assert gpu_compile_options(f"--{limit}=2", plan_flags)[limit] == 2  # the config's wins


def test_fsdp_without_stages_runs_one_layer_per_loop_iteration():
    """Layer loops are double-buffered (two layers an iteration) except where fsdp gathers
    weights without pipeline stages: there the next iteration's gather was left after the
    body's last matmul, exposed (docs/planner.md §7 "Stop 35 (Db)"). The plan's flag turns it
    off for those layouts only, the config's and ``XLA_FLAGS`` still win, and the memory model
    reads the same decision (``Layout.double_buffered``)."""
    from jaxmp._util.env import SINGLE_LAYER_BODY_GPU_FLAGS, gpu_compile_options
    from jaxmp.plan.layout import Layout, mesh_items

    def layout(mb: int, stage: int = 1, **mesh: int) -> Layout:
        sizes = {"data": 1, "stage": stage, "fsdp": 1, "tensor": 1, **mesh}
        return Layout(mesh_items(sizes), "full", mb)

    db = "xla_gpu_enable_while_loop_double_buffering"
    assert gpu_compile_options()[db] is True  # jaxmp's default
    for single in (layout(1, fsdp=8), layout(4, fsdp=4, tensor=2), layout(2, data=2, fsdp=4)):
        assert not single.double_buffered
        assert SINGLE_LAYER_BODY_GPU_FLAGS in single.xla_flags.split()
        assert gpu_compile_options("", single.xla_flags)[db] is False
        assert gpu_compile_options(f"--{db}=true", single.xla_flags)[db] is True
    for double in (layout(4, data=2, tensor=4), layout(4, 2, fsdp=4), layout(1, data=8)):
        assert double.double_buffered and SINGLE_LAYER_BODY_GPU_FLAGS not in double.xla_flags
        assert gpu_compile_options("", double.xla_flags)[db] is True
