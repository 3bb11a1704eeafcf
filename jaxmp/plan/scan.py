"""What a scanned layer stack stores on the device: JAX's residual list or the fused set.

XLA's GPU compiler stacks only the residuals that survive fusion (``LayerCost.fused``: with
XLA attention two score arrays a layer, not JAX's three and the mask; docs/planner.md §7
"Stop 33 (Sc2)", "Stop 35 (Sc3)"); XLA:CPU stacks JAX's list. Grouped-query scores keep
JAX's list on GPUs too: there the backward copies score arrays between the pair's layouts
(transposed stacks and score-sized transposes, measured, not modelled), and the fused count
fell 15-22 % under the compiled peak; JAX's list over-counts them instead (the safe side).
"""

from __future__ import annotations

from jaxmp.cost import LayerCost
from jaxmp.cost.fusion import grouped_scores
from jaxmp.devices import DeviceProfile


def stores_fused(profile: DeviceProfile, lay: LayerCost, remat: str, seq: int) -> bool:
    """Whether ``lay``, run in a layer loop on ``profile``, stacks its fused residuals."""
    fused = lay.fused.get(remat)
    return bool(lay.in_loop and profile.scan_keeps_fused and fused is not None
                and not grouped_scores(fused.shapes, fused.batch_dims, seq))
