"""Pipeline parallelism's shared descriptions (layer 4): how layers split into stages, and the
schedules that order microbatches through them. The planner predicts from these and the
executor (:mod:`jaxmp.train.pipeline`) runs them, so the two cannot drift apart.

* :mod:`jaxmp.parallel.balance` — contiguous stage splits that minimise the slowest stage;
* :mod:`jaxmp.parallel.stages` — which layers each stage (chunk) holds, and the padded layout
  of a stacked layer axis over the ``stage`` mesh axis;
* :mod:`jaxmp.parallel.schedule` — GPipe, 1F1B and interleaved 1F1B as tick tables, with the
  closed forms (ticks, bubble, microbatches in flight) the planner uses.

What crosses the wire besides (docs/compression.md):

* :mod:`jaxmp.parallel.reduce` — the data-axis gradient reduction, once per step: per-replica
  gradients, the reducer, its state in ``TrainState.extra``, its bytes for the planner;
* :mod:`jaxmp.parallel.compress` — the encoded collectives (bf16, int8 blocks, PowerSGD) in
  one device's view;
* :mod:`jaxmp.parallel.gather` — fsdp weight gathers in bf16 or int8.
"""
