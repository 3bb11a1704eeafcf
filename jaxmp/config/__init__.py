"""Typed, validated configuration (stdlib only: importing this never imports jax).

* :mod:`jaxmp.config.fields` — the checked-field machinery (:class:`Section`);
* :mod:`jaxmp.config.sections` — the trainer's sections and :class:`TrainerConfig`;
* :mod:`jaxmp.config.io` — TOML + overrides → a config of any schema, and back to TOML.

The GPT recipe's ``[model]`` and ``[data]`` sections and its full ``Config`` live with the
recipe (:mod:`jaxmp.recipes.gpt_config`); ``jaxmp.load_config`` loads that schema.
"""

from jaxmp.config.fields import ConfigError, Section, bounded, require
from jaxmp.config.io import config_to_dict, config_to_toml, load, parse_override, replace
from jaxmp.config.sections import (ATTENTION_KINDS, BALANCES, GRAD_COMPRESSIONS, MESH_AXES, OPTIMIZER_SHARDINGS,
                                   REMAT_POLICY_NAMES,
                                   RENAMED, SCHEDULES, WEIGHT_GATHERS, CheckpointConfig,
                                   CompressionConfig, DeviceConfig, LoggingConfig, MeshConfig,
                                   OptimizerConfig, PipelineConfig, TrainConfig, TrainerConfig,
                                   XlaConfig, section_types)

__all__ = ["ATTENTION_KINDS", "BALANCES", "GRAD_COMPRESSIONS", "MESH_AXES", "OPTIMIZER_SHARDINGS",
           "REMAT_POLICY_NAMES",
           "RENAMED", "SCHEDULES", "WEIGHT_GATHERS", "CheckpointConfig", "CompressionConfig",
           "ConfigError", "DeviceConfig", "LoggingConfig", "MeshConfig", "OptimizerConfig",
           "PipelineConfig", "Section", "TrainConfig", "TrainerConfig", "XlaConfig", "bounded",
           "config_to_dict", "config_to_toml", "load", "parse_override", "replace", "require",
           "section_types"]
