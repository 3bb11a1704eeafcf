"""Logical names → mesh shardings, for parameters and activations (layer 2).

* :mod:`jaxmp.sharding.resolve` — the ordered rules and one array's resolution;
* :mod:`jaxmp.sharding.tree` — names of every array of a tree, its specs and shardings;
* :mod:`jaxmp.sharding.activations` — ``constrain`` activations by logical name;
* :mod:`jaxmp.sharding.params` — ``constrain_param`` where a model reads a weight slice (the
  trainer may gather it in a narrower dtype);
* :mod:`jaxmp.sharding.sequence` — sequence parallelism as a rule list (``seq`` over ``tensor``);
* :mod:`jaxmp.sharding.lint` — how far a tree is from ideal per-device memory, and why.

Research code uses the same names through the facade ``from jaxmp import rules``.
"""

from jaxmp.sharding.activations import (activation_sharding, constrain, current_mesh, gathered,
                                        named, recording_names, spec_without, splits)
from jaxmp.sharding.lint import LintReport, lint
from jaxmp.sharding.params import constrain_param, param_gathering
from jaxmp.sharding.resolve import (DEFAULT_RULES, Axes, Fallback, Names, PathRule, Resolution,
                                    Rule, fit_names, logical_spec, normalize_rules,
                                    normalize_spec, resolve)
from jaxmp.sharding.sequence import sequence_parallel_rules, shards_sequence
from jaxmp.sharding.tree import (METADATA_KEYS, Leaf, abstract, logical_names, names_of,
                                 resolve_leaves, shardings_for, specs_for, tree_leaves,
                                 without_eager_sharding)

__all__ = ["DEFAULT_RULES", "METADATA_KEYS", "Axes", "Fallback", "Leaf", "LintReport", "Names",
           "PathRule", "Resolution", "Rule", "abstract", "activation_sharding", "constrain",
           "constrain_param", "current_mesh", "fit_names", "gathered", "lint", "logical_names",
           "logical_spec", "named", "names_of", "normalize_rules", "normalize_spec",
           "param_gathering", "recording_names", "resolve", "resolve_leaves",
           "sequence_parallel_rules", "shardings_for", "shards_sequence", "spec_without",
           "specs_for", "splits", "tree_leaves", "without_eager_sharding"]
