"""jaxmp: a sharded trainer for JAX/Flax."""
from jaxmp.mesh import make_mesh

__all__ = ["make_mesh"]
__version__ = "0.1.0"
