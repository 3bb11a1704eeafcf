"""Recipes: a model, its loss, its data and its config sections, wired into the same Trainer.

The GPT recipe is :mod:`jaxmp.recipes.gpt` (``jaxmp train`` is ``gpt_trainer(config).fit()``)
with its config schema in :mod:`jaxmp.recipes.gpt_config`. This package file imports nothing,
so the config schema can be loaded before jax is imported.
"""
