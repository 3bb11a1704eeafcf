"""Test session set-up; must run before jax is imported anywhere.

- 8 simulated CPU devices, so every test can build meshes of up to 8 devices.
- examples/ on the import path: tests import the example trainers (``import train_custom``) as
  the files users run; examples/ is not part of the jaxmp package.
- A persistent JAX compilation cache (also inherited by the subprocesses tests start): the same
  tiny programs are compiled by many tests and an XLA CPU compile takes seconds. It changes how
  fast programs are obtained, never what they compute.
"""
import os
import sys
import tempfile
from pathlib import Path

from jaxmp._util.env import add_xla_flags  # stdlib only: jax is not imported yet

add_xla_flags("--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "jaxmp-test-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
