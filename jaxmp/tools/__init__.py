"""Tools built on the trainer (layer 8): compile and measure one strategy, check a plan's
predictions against the compiled program. Each compiles through ``Trainer.compile``, the step
``jaxmp train`` runs."""
