"""What a plan predicts for one layout: per device and per step, memory, time and bytes
(made by :mod:`jaxmp.plan.predict` and :mod:`jaxmp.plan.pipeline`, rendered by
:mod:`jaxmp.plan.render`, checked by ``jaxmp plan --verify``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STEP_STATE_BYTES = 4  # the step counter of the train state


@dataclass
class Prediction:
    """Per device and per step. Memory terms sum to ``per_device_bytes``; time terms (compute,
    bubble, the exposed communication of each axis) sum to ``step_time_s``."""

    param_bytes: float
    optimizer_bytes: float
    grad_bytes: float
    activation_bytes: float
    working_bytes: float
    batch_bytes: float
    argument_bytes: float
    per_device_bytes: float  # peak: arguments + temporaries
    flops_per_step: float  # the whole step, all devices
    flops_per_device: float
    compute_s: float
    bubble_s: float
    comm_s: dict[str, float]  # exposed: what each axis adds to the step
    comm_bytes: dict[str, float]  # bytes each device sends per step, by mesh axis
    step_time_s: float
    stages: list[tuple[int, int]]
    stage_time_s: list[float] = field(default_factory=list)
    comm_hidden_s: dict[str, float] = field(default_factory=dict)  # overlapped with compute
    working_parts: dict[str, float] = field(default_factory=dict)  # what the working set is
    activation_parts: dict[str, float] = field(default_factory=dict)
    blocks_per_chunk: list[int] = field(default_factory=list)  # with stages

    @property
    def comm_bytes_per_step(self) -> float:
        return sum(self.comm_bytes.values())

    def to_dict(self) -> dict[str, Any]:
        return {"per_device_bytes": self.per_device_bytes, "argument_bytes": self.argument_bytes,
                "param_bytes": self.param_bytes, "optimizer_bytes": self.optimizer_bytes,
                "grad_bytes": self.grad_bytes, "activation_bytes": self.activation_bytes,
                "working_bytes": self.working_bytes, "batch_bytes": self.batch_bytes,
                "working_parts": dict(self.working_parts),
                "activation_parts": dict(self.activation_parts),
                "step_time_s": self.step_time_s, "compute_s": self.compute_s,
                "bubble_s": self.bubble_s, "comm_s": dict(self.comm_s),
                "comm_hidden_s": dict(self.comm_hidden_s),
                "flops_per_step": self.flops_per_step, "flops_per_device": self.flops_per_device,
                "comm_bytes_per_step": self.comm_bytes_per_step,
                "comm_bytes_by_axis": dict(self.comm_bytes), "stage_time_s": self.stage_time_s,
                "blocks_per_chunk": list(self.blocks_per_chunk)}
