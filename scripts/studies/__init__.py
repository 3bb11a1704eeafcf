"""The studies behind the numbers in docs/, run by scripts/measure.py (one module each:
``DOC``, the doc it feeds; ``DEVICES``, whether it takes ``--devices`` / ``--simulate-devices``;
``add_arguments(parser)``; ``run(args)``). jax is imported inside ``run``, after the driver has
set up the simulated devices."""
