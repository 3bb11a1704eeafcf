"""The planner (layer 5): mesh, stages, schedule, remat and microbatches chosen from a model's
costs.

* :mod:`jaxmp.plan.plan` — :class:`Plan`, :func:`plan`, :func:`plan_for_config`;
* :mod:`jaxmp.plan.search` — enumerate and rank layouts;
* :mod:`jaxmp.plan.context` — a model's per-layer costs resolved on a candidate mesh;
* :mod:`jaxmp.plan.predict` — per-device memory, communication and step time of one layout;
* :mod:`jaxmp.plan.pipeline` — the same for a layout with pipeline stages, from the schedule
  and stage split the executor runs;
* :mod:`jaxmp.plan.render` — the text report ``jaxmp plan`` prints.

It knows no model and no trainer: models arrive as :class:`jaxmp.cost.ModelCost`.
"""

from jaxmp.errors import PlanError
from jaxmp.pipeline.balance import InfeasibleError, balance_stages, stage_sums
from jaxmp.plan.context import Context, Layout, Prediction
from jaxmp.plan.plan import Plan, plan, plan_for_config
from jaxmp.plan.predict import predict
from jaxmp.plan.search import PipelineOptions

__all__ = ["Context", "InfeasibleError", "Layout", "PipelineOptions", "Plan", "PlanError",
           "Prediction", "balance_stages", "plan", "plan_for_config", "predict", "stage_sums"]
