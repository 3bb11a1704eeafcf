"""What crosses the wire, made smaller (layer 4; docs/compression.md).

* :mod:`jaxmp.compression.reduce` — the data-axis gradient reduction, once per step: per-replica
  gradients, the reducer, its state in ``TrainState.extra``, its bytes for the planner;
* :mod:`jaxmp.compression.codecs` — the encoded collectives (bf16, int8 blocks, PowerSGD) in
  one device's view;
* :mod:`jaxmp.compression.gather` — fsdp weight gathers in bf16 or int8.
"""
