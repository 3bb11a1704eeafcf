"""The planner's parts: FLOP counting, layer tracing, stage balancing, prediction, search,
verification and the ``jaxmp plan`` command. The public entry points are :mod:`jaxmp.cost` and
:mod:`jaxmp.planner`; importing this package does not import jax (the CLI needs that)."""
