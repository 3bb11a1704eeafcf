"""Test session set-up; must run before jax is imported anywhere.

- 8 simulated CPU devices, so every test can build meshes of up to 8 devices.
- examples/ on the import path: tests import the example trainers (``import train_custom``) as
  the files users run; examples/ is not part of the jaxmp package.
- A persistent JAX compilation cache (also inherited by the subprocesses tests start): the same
  tiny programs are compiled by many tests and an XLA CPU compile takes seconds. It changes how
  fast programs are obtained, never what they compute.
- XLA's backend code optimisation off (LLVM at -O0, its expensive passes skipped), as
  jaxmp.hlo.partitioned does for its HLO dumps: the suite's programs are tiny and compile-bound
  (seconds to compile, milliseconds to run), and this halves a CPU compile. The HLO program
  — partitioning, collectives, fusion, buffer assignment, memory_analysis() — is the same;
  only the machine code differs, so float results may differ from an optimised build in the
  last bit. Every comparison here is between programs compiled under these same flags, or
  within a tolerance (subprocesses that reset XLA_FLAGS compile optimised, among themselves;
  those started with test_checkpoint_helpers.subprocess_env get these flags too).
"""
import os
import sys
import tempfile
from pathlib import Path

from jaxmp._util.env import add_xla_flags  # stdlib only: jax is not imported yet

# subprocess_env (test_checkpoint_helpers) hands these to the jaxmp processes tests start
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
add_xla_flags("--xla_force_host_platform_device_count=8 " + FAST_COMPILE_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "jaxmp-test-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
