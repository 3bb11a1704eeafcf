"""Tokenizers for ``jaxmp data prepare`` and ``jaxmp sample``, built on Hugging Face ``tokenizers``.

Three kinds, named as on the command line:

- ``bytes``: ids are the text's UTF-8 bytes (vocab 256), jaxmp's stdlib scheme. Its
  ``tokenizer.json`` is a byte-level BPE without merges whose ids equal the byte values, so other
  tools read it too; byte 0 separates documents, as in the stdlib corpus;
- ``bpe:N``: a byte-level BPE of N tokens trained on the input itself (offline), with
  ``<|endoftext|>`` (id 0) between documents; every string encodes (bytes fall back);
- ``PATH/tokenizer.json``: an existing tokenizer; its end-of-text token, if it has a usual one,
  separates documents.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxmp.data.meta import RUN_META, TOKENIZER, read_meta
from jaxmp.data.stdlib import SEPARATOR
from jaxmp.errors import DataError, UsageError

EOT = "<|endoftext|>"
_END_TOKENS = (EOT, "</s>", "<|end_of_text|>", "<eos>", "[SEP]")  # tried in this order
BYTE_VOCAB = 256


@dataclass(frozen=True)
class TokenizerSpec:
    """``--tokenizer`` parsed: ``kind`` is bytes, bpe or file."""

    kind: str
    size: int = BYTE_VOCAB
    path: Path | None = None

    @property
    def name(self) -> str:
        return {"bytes": "bytes", "bpe": f"bpe:{self.size}"}.get(self.kind, str(self.path))


def parse_spec(text: str) -> TokenizerSpec:
    """``bytes`` | ``bpe:N`` | a path to a ``tokenizer.json`` (UsageError otherwise)."""
    if text == "bytes":
        return TokenizerSpec("bytes")
    if text.startswith("bpe:"):
        try:
            size = int(text[4:])
        except ValueError:
            raise UsageError(f"--tokenizer {text!r}: expected bpe:N with an integer N") from None
        if size < BYTE_VOCAB + 1:
            raise UsageError(f"--tokenizer {text!r}: a byte-level BPE needs N >= "
                             f"{BYTE_VOCAB + 1} (256 bytes and {EOT})")
        return TokenizerSpec("bpe", size)
    path = Path(text)
    if not path.is_file():
        raise UsageError(f"--tokenizer {text!r}: expected 'bytes', 'bpe:N' or a tokenizer.json "
                         f"file (not found)")
    return TokenizerSpec("file", path=path)


def _byte_chars() -> list[str]:
    """The character ByteLevel pre-tokenization writes for each byte (GPT-2's printable map)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(BYTE_VOCAB)]


def byte_tokenizer() -> Tokenizer:
    """A tokenizer whose ids are exactly the UTF-8 bytes of the text."""
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(_byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens learnt from ``texts`` (streamed)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exceptions
        raise DataError(f"{path}: not a Hugging Face tokenizer.json: "
                        f"{' '.join(str(e).split())[:200]}") from None


def end_token(tok: Tokenizer) -> int | None:
    """The id of the tokenizer's end-of-text token, if it has one of the usual names."""
    for text in _END_TOKENS:
        found = tok.token_to_id(text)
        if found is not None:
            return found
    return None


@dataclass
class Codec:
    """Text ⇄ ids for sampling: a run's ``tokenizer.json``, or raw bytes when it has none."""

    tokenizer: Tokenizer | None  # None: ids are UTF-8 bytes
    separator: int | None  # the document-boundary id (sampling starts from it)

    @classmethod
    def for_run(cls, run_dir: str | Path) -> Codec:
        """The run's tokenizer (copied there by training on a prepared folder), else bytes."""
        run_dir = Path(run_dir)
        if not (run_dir / TOKENIZER).is_file():
            return cls(None, SEPARATOR)
        tok = load_tokenizer(run_dir / TOKENIZER)
        separator = end_token(tok)
        if (run_dir / RUN_META).is_file():
            sep = json.loads((run_dir / RUN_META).read_text()).get("separator")
            separator = sep["id"] if sep else None
        return cls(tok, separator)

    @classmethod
    def for_folder(cls, folder: str | Path) -> Codec:
        """The tokenizer of a prepared folder."""
        meta = read_meta(folder)
        sep = meta.get("separator")
        return cls(load_tokenizer(Path(folder) / TOKENIZER), sep["id"] if sep else None)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (a model's vocabulary may be padded past it)."""
        return self.tokenizer.get_vocab_size() if self.tokenizer else BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; DataError naming the parts the tokenizer cannot encode (an unknown
        token, or characters it drops). Byte-level tokenizers encode everything."""
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        unk = getattr(self.tokenizer.model, "unk_token", None)
        unk_id = self.tokenizer.token_to_id(unk) if unk else None
        bad = [text[a:b] for i, (a, b) in zip(enc.ids, enc.offsets) if i == unk_id]
        if not bad and self.decode(enc.ids) != text:  # dropped, or only normalised?
            covered = {k for a, b in enc.offsets for k in range(a, b)}
            bad = [c for k, c in enumerate(text) if k not in covered and not c.isspace()]
        if bad:
            raise DataError(f"--prompt: the run's tokenizer cannot encode "
                            f"{' '.join(dict.fromkeys(bad))[:40]!r} (it has no byte fallback)")
        return enc.ids

    def decode(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        if self.tokenizer is None:
            return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=False)
