"""Tests for jaxmp.data: sources, deterministic global batches, per-process shards, resume."""
import json
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import jaxmp
from jaxmp import data
from jaxmp.data import DataError, make_batches


def _write_bin(path: Path, tokens: np.ndarray, dtype: str) -> Path:
    np.asarray(tokens, dtype={"uint16": "<u2", "uint32": "<u4"}[dtype]).tofile(path)
    return path


@pytest.fixture
def counting_bin(tmp_path: Path) -> Path:
    """Token value == position, so every row reveals where it was read from."""
    return _write_bin(tmp_path / "count.bin", np.arange(1000), "uint32")


@pytest.fixture(scope="session")
def stdlib_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the stdlib corpus once per session into a temp cache."""
    cache = tmp_path_factory.mktemp("jaxmp-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXMP_CACHE", str(cache))
        data.build_stdlib_corpus(0.01)
    return cache


def _take(it, n: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(n)]


def _same(a, b) -> bool:
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in ("inputs", "targets"))


def test_same_seed_same_stream_different_seed_differs(counting_bin):
    kw = dict(seq_len=16, global_batch=8, vocab_size=1000, token_dtype="uint32",
              process_index=0, process_count=1)
    a = _take(make_batches(str(counting_bin), seed=1, **kw), 5)
    b = _take(make_batches(str(counting_bin), seed=1, **kw), 5)
    c = _take(make_batches(str(counting_bin), seed=2, **kw), 5)
    assert _same(a, b)
    assert not _same(a, c)
    assert a[0]["inputs"].shape == (8, 16) and a[0]["inputs"].dtype == np.int32


def test_windows_are_shifted_and_each_epoch_is_a_new_permutation(counting_bin):
    # 1000 tokens, eval 1% -> 990 train tokens -> (990 - 1) // 10 = 98 windows of stride 10.
    it = make_batches(str(counting_bin), seq_len=10, global_batch=98, seed=0, vocab_size=1000,
                      token_dtype="uint32", process_index=0, process_count=1)
    assert it.n_windows == 98
    epochs = []
    for b in _take(it, 2):
        np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
        np.testing.assert_array_equal(b["targets"][:, -1], b["inputs"][:, -1] + 1)
        np.testing.assert_array_equal(b["inputs"] - b["inputs"][:, :1], np.tile(np.arange(10), (98, 1)))
        starts = b["inputs"][:, 0]
        assert np.all(starts % 10 == 0)
        assert sorted(starts // 10) == list(range(98))  # every window once per epoch
        epochs.append(starts)
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[0], np.arange(98) * 10)  # actually shuffled


@pytest.mark.parametrize("procs", [2, 4])
def test_process_shards_are_disjoint_and_concatenate_to_global(counting_bin, procs):
    kw = dict(seq_len=8, global_batch=8, seed=3, vocab_size=1000, token_dtype="uint32")
    whole = _take(make_batches(str(counting_bin), process_index=0, process_count=1, **kw), 4)
    parts = [_take(make_batches(str(counting_bin), process_index=p, process_count=procs, **kw), 4)
             for p in range(procs)]
    for step in range(4):
        rows = [parts[p][step]["inputs"] for p in range(procs)]
        assert all(r.shape == (8 // procs, 8) for r in rows)
        starts = [set(r[:, 0].tolist()) for r in rows]
        assert sum(len(s) for s in starts) == len(set().union(*starts)) == 8  # disjoint
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(
                np.concatenate([parts[p][step][key] for p in range(procs)]), whole[step][key])


def test_batch_not_divisible_by_processes(counting_bin):
    with pytest.raises(DataError, match="not divisible by the process count 3"):
        make_batches(str(counting_bin), seq_len=8, global_batch=8, seed=0, vocab_size=1000,
                     token_dtype="uint32", process_index=0, process_count=3)


def test_state_resumes_same_stream_also_on_other_process_count(counting_bin):
    kw = dict(seq_len=8, global_batch=8, seed=5, vocab_size=1000, token_dtype="uint32")
    ref = _take(make_batches(str(counting_bin), process_index=0, process_count=1, **kw), 6)
    it = make_batches(str(counting_bin), process_index=0, process_count=1, **kw)
    _take(it, 3)
    state = json.loads(json.dumps(it.get_state()))  # must survive JSON
    assert state["step"] == 3 and state["seed"] == 5 and state["global_batch"] == 8

    same = make_batches(str(counting_bin), process_index=0, process_count=1, **kw)
    same.set_state(state)
    assert _same(_take(same, 3), ref[3:])

    halves = [make_batches(str(counting_bin), process_index=p, process_count=2, **kw) for p in (0, 1)]
    for h in halves:
        h.set_state(state)
    for step in range(3, 6):
        got = np.concatenate([next(h)["inputs"] for h in halves])
        np.testing.assert_array_equal(got, ref[step]["inputs"])


@pytest.mark.parametrize("key,value", [("seq_len", 16), ("global_batch", 4), ("seed", 6),
                                       ("fingerprint", "bin:other")])
def test_set_state_rejects_other_stream(counting_bin, key, value):
    it = make_batches(str(counting_bin), seq_len=8, global_batch=8, seed=5, vocab_size=1000,
                      token_dtype="uint32", process_index=0, process_count=1)
    state = {**it.get_state(), key: value}
    with pytest.raises(DataError, match=key):
        it.set_state(state)
    assert it.step == 0


@pytest.mark.parametrize("dtype,high", [("uint16", 60000), ("uint32", 100000)])
def test_bin_memmap_reads_known_tokens(tmp_path, dtype, high):
    tokens = high - np.arange(101)  # near the top of the range: catches a wrong dtype/endianness
    path = _write_bin(tmp_path / f"t_{dtype}.bin", tokens, dtype)
    it = make_batches(str(path), seq_len=4, global_batch=25, seed=0, vocab_size=high + 1,
                      token_dtype=dtype, eval_fraction=0.0, process_index=0, process_count=1)
    assert isinstance(it.tokens.tokens, np.memmap)
    b = next(it)
    order = np.argsort(-b["inputs"][:, 0])  # window k starts at high - 4k
    np.testing.assert_array_equal(b["inputs"][order], (high - np.arange(100)).reshape(25, 4))
    np.testing.assert_array_equal(b["targets"][order], (high - 1 - np.arange(100)).reshape(25, 4))


def test_bin_eval_split_is_the_tail(tmp_path):
    path = _write_bin(tmp_path / "t.bin", np.arange(200), "uint16")
    it = make_batches(str(path), split="eval", seq_len=4, global_batch=4, seed=0, vocab_size=200,
                      eval_fraction=0.1, process_index=0, process_count=1)
    assert it.tokens.n_tokens == 20
    b = next(it)
    assert b["inputs"].min() >= 180 and b["targets"].max() <= 199
    train = make_batches(str(path), seq_len=4, global_batch=4, seed=0, vocab_size=200,
                         eval_fraction=0.1, process_index=0, process_count=1)
    assert train.tokens.n_tokens == 180 and train.tokens.fingerprint != it.tokens.fingerprint


def test_token_ids_over_vocab_rejected(tmp_path):
    path = _write_bin(tmp_path / "big.bin", [1, 2, 70000, 3], "uint32")
    with pytest.raises(DataError) as err:
        make_batches(str(path), seq_len=2, global_batch=1, seed=0, vocab_size=50257,
                     token_dtype="uint32", process_index=0, process_count=1)
    msg = str(err.value)
    assert "big.bin" in msg and "70000" in msg and "50257" in msg and "\n" not in msg


def test_missing_file_is_one_clear_line(tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(DataError, match="data file not found: .*nope.bin") as err:
        make_batches(str(missing), seq_len=2, global_batch=1, seed=0, vocab_size=10)
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)


def test_stdlib_corpus_splits_by_file(stdlib_cache, monkeypatch):
    monkeypatch.setenv("JAXMP_CACHE", str(stdlib_cache))
    path, meta = data.build_stdlib_corpus(0.01)
    assert path.parent == stdlib_cache and not list(stdlib_cache.glob("*.tmp"))
    train, held = set(meta["train_files"]), set(meta["eval_files"])
    assert train and held and not train & held
    assert not any("site-packages" in f for f in train | held)
    assert 0.003 < meta["eval_bytes"] / (meta["train_bytes"] + meta["eval_bytes"]) < 0.03
    # The eval split is exactly the held-out files, each followed by the separator byte.
    root = Path(sysconfig.get_paths()["stdlib"])
    expected = b"".join((root / f).read_bytes() + b"\0" for f in meta["eval_files"])
    ev = data.open_tokens("stdlib", split="eval", vocab_size=256)
    assert bytes(np.asarray(ev.tokens)) == expected
    first = (root / meta["train_files"][0]).read_bytes()
    tr = data.open_tokens("stdlib", split="train", vocab_size=256)
    assert bytes(np.asarray(tr.tokens[:len(first)])) == first and tr.n_tokens == meta["train_bytes"]
    for split in ("train", "eval"):
        b = next(make_batches("stdlib", split=split, seq_len=32, global_batch=4, seed=0,
                              vocab_size=256, process_index=0, process_count=1))
        assert b["inputs"].shape == (4, 32) and 0 <= b["inputs"].min() and b["inputs"].max() < 256


def test_stdlib_cache_is_reused(stdlib_cache, monkeypatch):
    monkeypatch.setenv("JAXMP_CACHE", str(stdlib_cache))
    path, _ = data.build_stdlib_corpus(0.01)
    before = path.stat().st_mtime_ns
    again, _ = data.build_stdlib_corpus(0.01)
    assert again == path and again.stat().st_mtime_ns == before
    info = data.corpus_info("stdlib", split="eval")
    assert info["files"] >= 1 and info["tokens"] == info["bytes"] > 0


def test_stdlib_needs_byte_vocab(stdlib_cache, monkeypatch):
    monkeypatch.setenv("JAXMP_CACHE", str(stdlib_cache))
    with pytest.raises(DataError, match="vocab_size >= 256"):
        make_batches("stdlib", seq_len=8, global_batch=2, seed=0, vocab_size=100)


def test_split_files_holds_out_about_the_fraction():
    files = [(f"f{i:03d}.py", 100 + i) for i in range(300)]
    train, held = data.split_files(files, 0.1)
    sizes = dict(files)
    share = sum(sizes[f] for f in held) / sum(sizes.values())
    assert 0.1 <= share < 0.11 and not set(train) & set(held)
    assert train == sorted(train) and len(train) + len(held) == 300
    assert data.split_files(files, 0.1) == (train, held)  # deterministic


def test_synthetic_in_range_and_deterministic():
    kw = dict(seq_len=64, global_batch=8, vocab_size=37, process_index=0, process_count=1)
    a = _take(make_batches("synthetic", seed=0, **kw), 2)
    assert _same(a, _take(make_batches("synthetic", seed=0, **kw), 2))
    assert not _same(a, _take(make_batches("synthetic", seed=1, **kw), 2))
    x = np.stack([b["inputs"] for b in a])
    assert x.min() >= 0 and x.max() < 37 and len(np.unique(x)) == 37
    np.testing.assert_array_equal(a[0]["targets"][:, :-1], a[0]["inputs"][:, 1:])


def test_to_global_shape_and_sharding(counting_bin):
    mesh = jaxmp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    b = next(make_batches(str(counting_bin), seq_len=8, global_batch=8, seed=0, vocab_size=1000,
                          token_dtype="uint32"))
    g = data.to_global(b, mesh)
    arr = g["inputs"]
    assert isinstance(arr, jax.Array) and arr.shape == (8, 8) and arr.dtype == np.int32
    assert arr.sharding == NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    np.testing.assert_array_equal(np.asarray(arr), b["inputs"])
    np.testing.assert_array_equal(np.asarray(g["targets"]), b["targets"])
    shards = arr.addressable_shards
    assert len(shards) == 8 and all(s.data.shape == (2, 8) for s in shards)
    # tensor replicates the batch: both tensor devices of a (data, fsdp) cell hold equal rows
    by_rows = {}
    for s in shards:
        by_rows.setdefault(s.index[0].start, []).append(np.asarray(s.data))
    assert len(by_rows) == 4 and all(np.array_equal(*v) for v in by_rows.values())


def test_to_global_rejects_indivisible_batch(counting_bin):
    mesh = jaxmp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    b = {"inputs": np.zeros((6, 4), np.int32)}
    with pytest.raises(DataError, match="not divisible by the 4 batch shards"):
        data.to_global(b, mesh)
