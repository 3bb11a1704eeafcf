"""Reading compiled XLA programs back: collectives and the bytes each device sends per step.

* :mod:`jaxmp.hlo.module` — the HLO text parsed into computations, with loop trip counts;
* :mod:`jaxmp.hlo.collectives` — :func:`collective_stats`, ring formulas, folding the CPU
  backend's all-reduce + dynamic-slice into the reduce-scatter GPUs emit;
* :mod:`jaxmp.hlo.overlap` — :func:`collective_overlap`: which async collectives of a scheduled
  (GPU) program have a matmul between their start and done, and which are exposed;
* :mod:`jaxmp.hlo.partitioned` — the module before the CPU backend widens bf16 collectives.
"""

from jaxmp.hlo.collectives import KINDS, CollectiveOp, CollectiveStats, collective_stats
from jaxmp.hlo.module import shape_bytes
from jaxmp.hlo.overlap import OverlapStats, ScheduledCollective, collective_overlap
from jaxmp.hlo.partitioned import partitioned_text

__all__ = ["KINDS", "CollectiveOp", "CollectiveStats", "OverlapStats", "ScheduledCollective",
           "collective_overlap", "collective_stats", "partitioned_text", "shape_bytes"]
