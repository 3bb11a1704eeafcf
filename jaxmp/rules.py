"""``from jaxmp import rules``: jaxmp's sharding rules for any Flax model or pytree, no trainer.

A facade over :mod:`jaxmp.sharding`: ``rules.DEFAULT_RULES``, ``rules.specs_for``,
``rules.shardings_for``, ``rules.lint`` (a :class:`LintReport`), ``rules.constrain`` and
``rules.activation_sharding`` for activations (``rules.sequence_parallel_rules`` shards the
residual stream's sequence over ``tensor``), ``rules.abstract(model_fn)`` to build a model's
shapes and names without memory, and the lower-level pieces they are built from.
"""

from jaxmp import sharding
from jaxmp.sharding import (DEFAULT_RULES, METADATA_KEYS, Axes, Fallback, Leaf, LintReport, Names,
                            PathRule, Resolution, Rule, abstract, activation_sharding,
                            constrain, fit_names, lint, logical_names, logical_spec, names_of,
                            normalize_rules, normalize_spec, resolve, resolve_leaves,
                            sequence_parallel_rules, shardings_for, shards_sequence,
                            specs_for, tree_leaves, without_eager_sharding)

__all__ = list(sharding.__all__)
