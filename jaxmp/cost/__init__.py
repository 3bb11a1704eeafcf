"""Per-layer costs of any Flax NNX model — FLOPs, parameter, optimizer and activation bytes —
measured from its traced training program; the planner's only view of a model.

* :mod:`jaxmp.cost.model` — :func:`model_costs`, :class:`ModelCost`, :class:`LayerCost`;
* :mod:`jaxmp.cost.trace` — find a model's layers and trace it with them scoped;
* :mod:`jaxmp.cost.flops` — FLOPs counted from a jaxpr, with loop trip counts;
* :mod:`jaxmp.cost.layer` — one layer traced alone under each remat policy;
* :mod:`jaxmp.cost.fusion`, :mod:`jaxmp.cost.liveness` — what a compiler keeps alive.
"""

from jaxmp.cost.layer import Saved, xla_layer_check
from jaxmp.cost.model import LayerCost, ModelCost, model_costs
from jaxmp.remat import REMAT_POLICIES

__all__ = ["REMAT_POLICIES", "LayerCost", "ModelCost", "Saved", "model_costs", "xla_layer_check"]
