"""The planner (layer 5): every decision that shapes the train step, made once.

* :mod:`jaxmp.plan.make` — :func:`make_plan`, the one planning function: a run's config (its
  fixed keys as constraints) and a model's costs → a :class:`Plan`;
* :mod:`jaxmp.plan.layout` — :class:`Layout`, the record of what the step runs (mesh, remat,
  microbatches, schedule, stage split, data reduction, gather dtype, compression);
* :mod:`jaxmp.plan.plan` — :class:`Plan` and the search behind it, :func:`plan`;
* :mod:`jaxmp.plan.search` — enumerate and rank layouts;
* :mod:`jaxmp.plan.context` — a model's per-layer costs resolved on a candidate mesh
  (:class:`LayerTable`);
* :mod:`jaxmp.plan.predict` — per-device memory, communication and step time of one layout;
* :mod:`jaxmp.plan.pipeline` — the same for a layout with pipeline stages, from the schedule
  and stage split the executor runs;
* :mod:`jaxmp.plan.render` — the text report ``jaxmp plan`` prints.

It knows no model and no trainer: models arrive as :class:`jaxmp.cost.ModelCost`.
"""

from jaxmp.errors import PlanError
from jaxmp.pipeline.balance import InfeasibleError, balance_stages, stage_sums
from jaxmp.plan.context import Context, LayerTable
from jaxmp.plan.layout import Layout
from jaxmp.plan.make import check_batch, make_plan
from jaxmp.plan.plan import Plan, plan
from jaxmp.plan.predict import predict
from jaxmp.plan.prediction import Prediction
from jaxmp.plan.search import PipelineOptions

__all__ = ["Context", "InfeasibleError", "LayerTable", "Layout", "PipelineOptions", "Plan",
           "PlanError", "Prediction", "balance_stages", "check_batch", "make_plan", "plan",
           "predict", "stage_sums"]
