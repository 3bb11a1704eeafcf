"""Tools built on the trainer (layer 8): compile and measure one strategy, check a plan's
predictions against the compiled program, bench strategies side by side, draw runs. Each
compiles through ``Trainer.compile``, the step ``jaxmp train`` runs."""
