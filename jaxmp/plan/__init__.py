"""The planner (layer 5): mesh, stages, remat and microbatches chosen from a model's costs.

* :mod:`jaxmp.plan.plan` — :class:`Plan`, :func:`plan`, :func:`plan_for_config`;
* :mod:`jaxmp.plan.search` — enumerate and rank layouts;
* :mod:`jaxmp.plan.predict` — per-device memory, communication and step time of one layout;
* :mod:`jaxmp.plan.render` — the text report ``jaxmp plan`` prints.

It knows no model and no trainer: models arrive as :class:`jaxmp.cost.ModelCost`.
"""

from jaxmp.errors import PlanError
from jaxmp.parallel.balance import InfeasibleError, balance_stages, stage_sums
from jaxmp.plan.plan import Plan, plan, plan_for_config
from jaxmp.plan.predict import Context, Layout, Prediction, predict

__all__ = ["Context", "InfeasibleError", "Layout", "Plan", "PlanError", "Prediction",
           "balance_stages", "plan", "plan_for_config", "predict", "stage_sums"]
