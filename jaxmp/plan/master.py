"""What a float32 master of 16-bit params costs per device (``train.master_weights``,
:mod:`jaxmp.train.master`): the planner's side, used by :mod:`jaxmp.plan.predict` and
:mod:`jaxmp.plan.pipeline`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxmp.cost import ModelCost
from jaxmp.plan.layout import Layout, master_weights


def itemsize(cost: ModelCost) -> float:
    """Bytes per element of the model's narrowest floating params (4 without any)."""
    sizes = [leaf.nbytes / max(1, math.prod(leaf.shape)) for lay in cost.layers
             for leaf in lay.params if math.prod(leaf.shape)]
    return float(min(sizes)) if sizes else 4.0


def accumulator_width(cost: ModelCost) -> float:
    """Bytes of the microbatches' gradient sum per stored param byte: float32 at least, with or
    without a master (:func:`jaxmp.train.step.make_grad_fn`, the pipeline executor) — 2 for
    16-bit params."""
    return max(1.0, 4.0 / itemsize(cost))


def master_weights_of(configured: str, cost: ModelCost) -> str:
    """``train.master_weights`` decided for ``cost``'s model (its params' dtype)."""
    item = itemsize(cost)
    return master_weights(configured, "bfloat16" if item == 2 else "float32")


@dataclass(frozen=True)
class MasterTerms:
    """Per device: ``stored`` (the params argument), ``optimizer`` (its state), ``copy`` (the
    16-bit params a step computes with beside a float32 master: a temporary) and ``wide``
    (the gradients' bytes per stored param byte once they reach the optimizer)."""

    stored: float
    optimizer: float
    copy: float
    wide: float

    def data_factor(self, microbatches: int, zero: int) -> float:
        """The data reduction's bytes per stored param byte, times ``(data-1)/data``: an
        all-reduce (2), or a reduce-scatter and an all-gather of the updated params (1 + 1).
        With a master the gradients are reduced 16-bit from one backward pass, float32 once
        summed over microbatches, and the params gathered 16-bit (GPU-compiled; XLA's CPU
        backend widens 16-bit collectives to float32)."""
        grads = self.wide if microbatches > 1 else 1.0
        return grads + (1.0 if zero > 1 else grads)


def master_terms(factor: float, layout: Layout, params: float, optimizer: float,
                 zero: int) -> MasterTerms:
    """``params`` / ``optimizer``: the model's own bytes per device (its dtype, the rules'
    sharding); ``factor``: the master's bytes per stored param byte; ``zero``: what the
    optimizer state is divided by beyond the params' sharding. With a float32 master (:mod:`jaxmp.train.master`) the state stores it and the
    moments in float32, cut over data with the optimizer; the 16-bit params are a copy."""
    if layout.master_weights == "none":
        return MasterTerms(params, optimizer / zero, 0.0, 1.0)
    return MasterTerms(params * factor / zero, optimizer * factor / zero, params, factor)
