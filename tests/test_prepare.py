"""`jaxmp data prepare`: exact round trips, streaming pieces, meta.json, bad input, and the
prepared folder driving the model's vocabulary."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from jaxmp.cli import main
from jaxmp.data import make_batches, read_meta
from jaxmp.data import prepare as prep
from jaxmp.data.tokenizer import EOT, Codec, byte_tokenizer, load_tokenizer
from jaxmp.errors import ConfigError
from jaxmp.recipes.gpt import resolve_data
from jaxmp.recipes.gpt_config import load_config

from helpers import WORDS, write_corpus

def prepare_cli(*args: str) -> int:
    return main(["data", "prepare", *args])


def split_docs(tok, ids: np.ndarray) -> list[str]:
    return tok.decode(ids.tolist(), skip_special_tokens=False).split(EOT)[:-1]


def test_bpe_round_trips_text_exactly(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "prep"
    assert prepare_cli(str(corpus), "--out", str(out), "--tokenizer", "bpe:300",
                       "--val-fraction", "0.2") == 0
    tok = load_tokenizer(out / "tokenizer.json")
    meta = read_meta(out)
    assert meta["vocab_size"] == tok.get_vocab_size() <= 300 and meta["dtype"] == "uint16"
    train = split_docs(tok, np.fromfile(out / "train.bin", "<u2"))
    val = split_docs(tok, np.fromfile(out / "val.bin", "<u2"))
    files = sorted(corpus.iterdir())
    assert len(train) == len(val) == len(files)  # every file: a train part, then a val part
    for path, head, tail in zip(files, train, val):
        text = path.read_bytes().decode("utf-8")
        assert head + tail == text
        assert 0.1 < len(tail.encode()) / len(text.encode()) < 0.3
    # A trained BPE still encodes text it never saw: byte-level, every byte has an id.
    unseen = "Zürich ∑ ¿qué? \t\x00 🚀🚀 \U0010FFFF"
    assert tok.decode(tok.encode(unseen).ids) == unseen
    assert len(tok.encode(" ".join(WORDS)).ids) < 0.6 * len(" ".join(WORDS).encode())  # merges


def test_bytes_tokenizer_ids_are_the_bytes(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", files=3)
    out = tmp_path / "prep"
    assert prepare_cli(str(corpus / "*.txt"), "--out", str(out), "--val-fraction", "0") == 0
    raw = b"".join(p.read_bytes() + b"\0" for p in sorted(corpus.iterdir()))
    assert bytes(np.fromfile(out / "train.bin", "<u2").astype(np.uint8)) == raw
    assert (out / "val.bin").stat().st_size == 0
    text = "naïve 🙂\n"
    assert load_tokenizer(out / "tokenizer.json").encode(text).ids == list(text.encode())
    assert byte_tokenizer().decode(list(text.encode())) == text


def test_meta_json_records_sources_counts_and_dtype(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", files=3)
    out = tmp_path / "prep"
    assert prepare_cli(str(corpus), str(corpus / "doc0.txt"), "--out", str(out),
                       "--dtype", "uint32") == 0
    meta = json.loads((out / "meta.json").read_text())
    files = sorted(corpus.iterdir())
    assert [s["path"] for s in meta["sources"]] == [str(p) for p in files]  # doc0 once
    assert [s["sha256"] for s in meta["sources"]] == [hashlib.sha256(p.read_bytes()).hexdigest()
                                                      for p in files]
    assert meta["bytes"] == sum(p.stat().st_size for p in files)
    assert meta["train_tokens"] + meta["val_tokens"] == meta["bytes"] + 2 * len(files)
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == ("bytes", 256, "uint32")
    assert (out / "train.bin").stat().st_size == 4 * meta["train_tokens"]
    batch = next(make_batches(str(out), seq_len=16, global_batch=2, seed=0, vocab_size=256,
                              process_index=0, process_count=1))
    assert batch["inputs"].shape == (2, 16) and batch["inputs"].max() < 256
    assert not list(out.glob("*.tmp"))


def test_pieces_stay_small_and_cut_at_character_boundaries(tmp_path, monkeypatch):
    """Streaming: a long line without newlines is cut into bounded pieces, never inside a
    UTF-8 character, and the pieces concatenate back to the file."""
    monkeypatch.setattr(prep, "PIECE", 7)
    monkeypatch.setattr(prep, "MAX_LINE", 16)
    text = ("é🙂x" * 50 + "\nshort\n" + "東" * 40).encode()
    path = tmp_path / "long.txt"
    path.write_bytes(text)
    out = list(prep.pieces(prep.SourceFile(path, len(text)), 0.25))
    assert b"".join(p for _, _, p in out) == text
    assert max(len(p) for _, _, p in out) < 16 + 7
    assert all(p.decode("utf-8") for _, _, p in out)
    splits = [s for s, _, _ in out]
    assert splits == sorted(splits, key=["train", "eval"].index) and "eval" in splits
    held = b"".join(p for s, _, p in out if s == "eval")
    assert 0.2 < len(held) / len(text) < 0.3
    assert [o for _, o, _ in out] == list(np.cumsum([0] + [len(p) for _, _, p in out])[:-1])


def test_meta_json_drives_the_vocab_size_and_dtype(tmp_path, capsys):
    out = tmp_path / "prep"
    assert prepare_cli(str(write_corpus(tmp_path / "c")), "--out", str(out),
                       "--tokenizer", "bpe:300", "--dtype", "uint32") == 0
    need = read_meta(out)["vocab_size"]
    assert 257 < need <= 300
    padded = resolve_data(load_config(None, [f"data.source={out}"]))
    assert padded.model.vocab_size == 320 and padded.data.token_dtype == "uint32"
    kept = resolve_data(load_config(None, [f"data.source={out}", "model.vocab_size=1000"]))
    assert kept.model.vocab_size == 1000
    assert resolve_data(padded) == padded
    assert resolve_data(load_config(None)).model.vocab_size == 256  # stdlib: bytes
    with pytest.raises(ConfigError, match=f"model.vocab_size: 256 is smaller than the {need}"):
        resolve_data(load_config(None, [f"data.source={out}", "model.vocab_size=256"]))
    capsys.readouterr()
    rc = main(["train", "--run-dir", str(tmp_path / "run"), "--set", f"data.source={out}",
               "--set", "model.vocab_size=256"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "model.vocab_size" in err, err


def _one_line_exit_2(capsys, args: list[str]) -> str:
    """The error `jaxmp prepare ARGS` prints, after checking it exits 2 with one line."""
    capsys.readouterr()
    assert prepare_cli(*args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_bad_inputs_are_one_clear_line(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "out")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    good = write_corpus(tmp_path / "good", files=1)
    cases = [
        ([str(tmp_path / "empty.txt")], "the input is empty"),
        ([str(tmp_path / "missing.txt")], "missing.txt: no such file"),
        ([str(tmp_path / "*.md")], "matches no files"),
        ([str(good), "--tokenizer", "bpe:70000", "--dtype", "uint16"], "--dtype uint16 cannot"),
        ([str(tmp_path / "latin1.txt"), "--tokenizer", "bpe:300"], "not UTF-8 text at byte 3"),
        ([str(good), "--tokenizer", "bpe:abc"], "bpe:N"),
        ([str(good), "--tokenizer", "bpe:100"], "N >= 257"),
        ([str(good), "--tokenizer", str(tmp_path / "nope.json")], "nope.json"),
        ([str(good), "--val-fraction", "1.5"], "--val-fraction"),
    ]
    for args, needle in cases:
        err = _one_line_exit_2(capsys, [*args, "--out", out])
        assert needle in err, (args, err)
    real_open = open

    def unreadable(path, *a, **k):
        if str(path).endswith("doc0.txt"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *a, **k)

    monkeypatch.setattr(prep, "open", unreadable, raising=False)  # root ignores chmod 000
    err = _one_line_exit_2(capsys, [str(good), "--out", out])
    assert "doc0.txt: cannot read: Permission denied" in err, err


def test_a_failed_prepare_leaves_the_previous_folder_intact(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", files=2)
    out = tmp_path / "prep"
    assert prepare_cli(str(corpus), "--out", str(out), "--tokenizer", "bpe:300") == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (corpus / "zz.txt").write_bytes(b"ok\n\xff\xfe broken\n")  # fails late, while encoding
    err = _one_line_exit_2(capsys, [str(corpus), "--out", str(out), "--tokenizer",
                                    str(out / "tokenizer.json")])
    assert "zz.txt: not UTF-8" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no .tmp, nothing changed


def test_codec_of_a_prepared_folder_and_prompt_checks(tmp_path):
    out = tmp_path / "prep"
    assert prepare_cli(str(write_corpus(tmp_path / "c", files=2)), "--out", str(out),
                       "--tokenizer", "bpe:300") == 0
    codec = Codec.for_folder(out)
    assert codec.separator == 0 and codec.decode(codec.encode("naïve 🚀")) == "naïve 🚀"
    assert Codec(None, 0).encode("é") == [0xC3, 0xA9]  # bytes fall back


def test_prompt_the_tokenizer_cannot_encode_is_one_clear_line():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    codec = Codec(words, None)
    assert codec.encode("hello world") == [0, 1]
    with pytest.raises(Exception, match=r"cannot encode 'hé'") as err:
        codec.encode("hello hé")
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)
