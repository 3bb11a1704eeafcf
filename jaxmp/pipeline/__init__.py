"""Pipeline parallelism (layer 4), in one place: how layers split into stages, the schedules that
order microbatches through them, and the executor that runs a schedule inside the jitted step.
The planner predicts from the same descriptions the executor runs, so the two cannot drift.

* :mod:`jaxmp.pipeline.balance` — contiguous stage splits that minimise the slowest stage;
* :mod:`jaxmp.pipeline.stages` — which layers each stage (chunk) holds, and the padded layout
  of a stacked layer axis over the ``stage`` mesh axis;
* :mod:`jaxmp.pipeline.schedule` — GPipe, 1F1B and interleaved 1F1B as tick tables, with the
  closed forms (ticks, bubble, microbatches in flight) the planner uses;
* :mod:`jaxmp.pipeline.footprint` — the executor's buffer slots in closed form;
* :mod:`jaxmp.pipeline.chunk` — a model's stage description (``PipelineSpec``), its stack in
  the padded layout, and what one device computes for one (microbatch, chunk);
* :mod:`jaxmp.pipeline.residuals` — what a chunk's forward keeps for its backward, without
  copies of the parameters;
* :mod:`jaxmp.pipeline.executor` — the executor: the schedule's ticks in named phases (inputs,
  forward, backward, shift) over ``stage``, and a forward-only evaluation.
"""
