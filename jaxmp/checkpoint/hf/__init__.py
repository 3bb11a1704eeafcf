"""Hugging Face Llama-family checkpoints in and out: Llama, Mistral and Qwen2 safetensors.

- :mod:`~jaxmp.checkpoint.hf.files`: a weights folder (one file or a sharded index) read one
  memory-mapped tensor at a time;
- :mod:`~jaxmp.checkpoint.hf.arch`: the architectures' ``config.json`` ⇄ the GPT's ``[model]``
  keys, and each tensor's name and layout;
- :mod:`~jaxmp.checkpoint.hf.load`: tensors placed straight onto a mesh, shard by shard, and
  a run directory written from them;
- :mod:`~jaxmp.checkpoint.hf.export`: a jaxmp checkpoint → HF tensors, ``config.json`` and an
  index, streamed one array at a time into files of bounded size.

The recipe glue (the GPT config from ``config.json`` plus ``--set``) is
:mod:`jaxmp.recipes.hf`.
"""

from jaxmp.checkpoint.hf.arch import ARCHITECTURES, model_keys, read_config
from jaxmp.checkpoint.hf.export import export_hf
from jaxmp.checkpoint.hf.files import Weights
from jaxmp.checkpoint.hf.load import import_checkpoint

__all__ = ["ARCHITECTURES", "Weights", "export_hf", "import_checkpoint", "model_keys",
           "read_config"]
