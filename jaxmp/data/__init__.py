"""Token streams for training, and turning a user's text into them.

- :mod:`~jaxmp.data.sources`: open ``"stdlib"``, ``"synthetic"``, a nanoGPT ``.bin`` file or a
  prepared folder as random-access tokens (:mod:`~jaxmp.data.tokens`), checked against the
  vocabulary; the stdlib corpus is built by :mod:`~jaxmp.data.stdlib`;
- :mod:`~jaxmp.data.batches`: deterministic global batches, per-process rows, resume state;
- :mod:`~jaxmp.data.prepare` (``jaxmp data prepare``) with :mod:`~jaxmp.data.tokenizer`: text
  files → ``train.bin`` / ``val.bin`` / ``tokenizer.json`` / ``meta.json``
  (:mod:`~jaxmp.data.meta`). Imported on demand: training does not need the tokenizer library.
"""

from jaxmp.data.batches import BatchIterator, make_batches, to_global
from jaxmp.data.meta import padded_vocab, read_meta
from jaxmp.data.sources import corpus_info, open_tokens
from jaxmp.data.stdlib import (SEPARATOR, STDLIB_VOCAB, build_stdlib_corpus, cache_dir,
                               split_files, stdlib_files)
from jaxmp.data.tokens import SYNTHETIC_TOKENS, ArrayTokens, SyntheticTokens, Tokens
from jaxmp.errors import DataError

__all__ = ["SEPARATOR", "STDLIB_VOCAB", "SYNTHETIC_TOKENS", "ArrayTokens", "BatchIterator",
           "DataError", "SyntheticTokens", "Tokens", "build_stdlib_corpus", "cache_dir",
           "corpus_info", "make_batches", "open_tokens", "padded_vocab", "read_meta",
           "split_files", "stdlib_files", "to_global"]
