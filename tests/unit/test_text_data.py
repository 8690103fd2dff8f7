"""Text data (distributed/data/{corpus,tokenizer,token_file,sampler}.py): tokenizing a folder round-trips its text,
the cache is reused and written atomically under a lock, sampling is deterministic, bad inputs are one-line
ConfigErrors."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from peerline.distributed.config import ConfigError
from peerline.distributed.data import tokenizer as tokenizer_mod
from peerline.distributed.data.corpus import path_corpus, stdlib_corpus
from peerline.distributed.data.sampler import TokenSampler
from peerline.distributed.data.token_file import open_token_file, sidecar_path, write_token_file
from peerline.distributed.data.tokenizer import cache_dir_for, load_tokenizer, text_tokens, tokenize_corpus
from peerline.files import atomic_write

DOCS = {
    "b.md": "# Notes\n\nPipelines split a model into stages; microbatches keep every stage busy.\n" * 20,
    "a.txt": "The quick brown fox jumps over the lazy dog. Ünïcödé too: λ → ∞.\n" * 30,
    "sub/c.py": "def f(x):\n    return x * 2  # doubles\n" * 25,
}


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "blob.dat").write_bytes(b"\x00\x01\x02binary")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.txt").write_text("never read")
    return root


def test_folder_round_trips_through_the_tokenizer(corpus_dir: Path, tmp_path: Path) -> None:
    tokens = text_tokens(str(corpus_dir), vocab_size=300, cache_root=tmp_path / "cache")
    assert tokens.tokens.dtype == np.uint16 and tokens.vocab <= 300 and tokens.eot_id is not None
    ids = np.asarray(tokens.tokens)
    assert ids[-1] == tokens.eot_id and int(ids.max()) < tokens.vocab
    cuts = np.flatnonzero(ids == tokens.eot_id)
    tok = load_tokenizer(tokens)
    decoded = [tok.decode(part.tolist()) for part in np.split(ids, cuts + 1)[:-1]]
    assert decoded == [DOCS[name] for name in sorted(DOCS)]  # sorted paths; binary and hidden files left out


def test_second_call_reuses_the_cache(corpus_dir: Path, tmp_path: Path, monkeypatch) -> None:
    first = text_tokens(str(corpus_dir), vocab_size=300, cache_root=tmp_path)
    folder = first.path.parent
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer was trained again")

    monkeypatch.setattr(tokenizer_mod, "train_tokenizer", no_training)
    second = text_tokens(str(corpus_dir), vocab_size=300, cache_root=tmp_path)
    assert np.array_equal(first.tokens, second.tokens)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    assert sorted(stamps) == [".lock", "tokenizer.json", "tokens.bin", "tokens.json"]
    # Other text or another vocabulary size is another cache folder.
    (corpus_dir / "a.txt").write_text("changed")
    assert cache_dir_for(path_corpus(corpus_dir), 300, tmp_path)[0] != folder
    assert cache_dir_for(path_corpus(corpus_dir), 301, tmp_path)[0] != cache_dir_for(path_corpus(corpus_dir), 300,
                                                                                       tmp_path)[0]


def test_atomic_write_leaves_no_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "tokens.bin"
    target.write_bytes(b"old")

    def fails_halfway(f) -> None:
        f.write(b"new, but")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_write(target, fails_halfway)
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["tokens.bin"]
    atomic_write(target, lambda f: f.write(b"new"))
    assert target.read_bytes() == b"new" and len(list(tmp_path.iterdir())) == 1


def _tokenize_in_child(corpus_dir: str, cache_root: str, log_path: str) -> None:
    real_build = tokenizer_mod._build_cache

    def logged_build(*args, **kwargs):
        with open(log_path, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # a slow build: the other processes reach the cache while it runs
        real_build(*args, **kwargs)

    tokenizer_mod._build_cache = logged_build
    tokenize_corpus(path_corpus(corpus_dir), vocab_size=300, cache_root=Path(cache_root))


def test_concurrent_processes_tokenize_once(corpus_dir: Path, tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    log_path = tmp_path / "builds.log"
    procs = [ctx.Process(target=_tokenize_in_child, args=(str(corpus_dir), str(tmp_path / "c"), str(log_path)))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(log_path.read_text().split()) == 1
    folder = cache_dir_for(path_corpus(corpus_dir), 300, tmp_path / "c")[0]
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "tokenizer.json", "tokens.bin", "tokens.json"]
    reference = text_tokens(str(corpus_dir), vocab_size=300, cache_root=tmp_path / "fresh")
    assert np.array_equal(open_token_file(folder / "tokens.bin").tokens, reference.tokens)


def test_sampler_is_deterministic_and_shifts_labels() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    sampler = TokenSampler(tokens, seq=16, micro_batch_size=4, seed=3)
    inputs, labels = sampler.batch(5, 2)
    assert inputs.dtype == labels.dtype == torch.int64 and inputs.shape == labels.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    offsets = sampler.offsets(5, 2)
    assert ((offsets >= 0) & (offsets <= 1000 - 17)).all()
    for row, start in enumerate(offsets):
        assert torch.equal(labels[row], torch.from_numpy(tokens[start + 1:start + 17].astype(np.int64)))
    # Same (seed, iteration, microbatch) -> same windows, from a fresh sampler too (another rank); others differ.
    other = TokenSampler(tokens, seq=16, micro_batch_size=4, seed=3)
    other.batch(0, 0)
    assert torch.equal(other.batch(5, 2)[0], inputs)
    assert not torch.equal(sampler.batch(5, 3)[0], inputs) and not torch.equal(sampler.batch(6, 2)[0], inputs)
    assert not torch.equal(TokenSampler(tokens, seq=16, micro_batch_size=4, seed=4).batch(5, 2)[0], inputs)
    staged_in, staged_lab = torch.empty(4, 16, dtype=torch.int64), torch.empty(4, 16, dtype=torch.int64)
    sampler.fill(staged_in, staged_lab, 5, 2)
    assert torch.equal(staged_in, inputs) and torch.equal(staged_lab, labels)


def test_nanogpt_bin_without_sidecar(tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    np.array([5, 1, 300, 7], dtype=np.uint16).tofile(path)
    opened = open_token_file(path)
    assert opened.vocab == 301 and opened.tokens.tolist() == [5, 1, 300, 7]
    np.array([5, 70_000], dtype=np.uint32).tofile(tmp_path / "big.bin")
    assert open_token_file(tmp_path / "big.bin", dtype="uint32", vocab=100_000).tokens.tolist() == [5, 70_000]
    written = write_token_file(tmp_path / "w.bin", np.array([3, 2, 1]), vocab=10, eot_id=0)
    assert sidecar_path(written.path).is_file() and written.vocab == 10 and written.tokens.tolist() == [3, 2, 1]


def test_default_corpus_is_the_stdlib_capped() -> None:
    corpus = stdlib_corpus(cap_bytes=50_000)
    docs = list(corpus.documents())
    assert sum(len(d.encode()) for d in docs) <= 50_000 + 3 * len(docs)  # U+FFFD may replace a cut character
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in corpus.files)
    assert corpus.digest() == stdlib_corpus(cap_bytes=50_000).digest() != stdlib_corpus(cap_bytes=60_000).digest()


def test_errors_are_one_line_config_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    tiny = tmp_path / "tiny.bin"
    np.array([1, 2, 3], dtype=np.uint16).tofile(tiny)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    cases = [
        (lambda: text_tokens(str(tmp_path / "missing")), "does not exist"),
        (lambda: text_tokens(str(tmp_path / "missing.bin")), "does not exist"),
        (lambda: text_tokens(str(tmp_path / "empty")), "no text files"),
        (lambda: TokenSampler(open_token_file(tiny).tokens, seq=8, micro_batch_size=1, seed=0), "too few"),
        (lambda: open_token_file(tiny, vocab=70_000), "does not fit uint16"),
        (lambda: open_token_file(tiny, vocab=3), "token id 3 >= vocab 3"),
        (lambda: open_token_file(odd), "whole number"),
        (lambda: open_token_file(tiny, dtype="int8"), "dtype"),
    ]
    for make, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            make()
        assert "\n" not in str(info.value)


def _sidecar(tmp_path: Path, **meta) -> Path:
    """A token file of ids 1, 2, 3 with the sidecar `meta` (write_token_file's keys, then these)."""
    path = tmp_path / "t.bin"
    np.array([1, 2, 3], dtype=np.uint16).tofile(path)
    full = {"dtype": "uint16", "vocab": 10, "count": 3, "max_id": 3, "eot_id": None, **meta}
    sidecar_path(path).write_text(json.dumps({k: v for k, v in full.items() if v is not DROP}))
    return path


DROP = object()


@pytest.mark.parametrize("meta,message", [
    ({"dtype": "float64"}, "dtype is 'float64'; token ids are uint16 or uint32"),
    ({"vocab": DROP, "max_id": DROP}, "lacks vocab, max_id"),
    ({"vocab": 1e11}, "vocab is 100000000000.0; it must be an integer from 1 to 65536"),
    ({"vocab": 10**11, "dtype": "uint32"}, "vocab is 100000000000; it must be an integer from 1 to 4294967296"),
    ({"count": "3"}, "count is '3'"),
    ({"max_id": 2}, "max_id is 2, but .*t.bin holds id 3"),
    ({"max_id": 10}, "max_id is 10; it must be an integer from -1"),
    ({"eot_id": 12}, "eot_id is 12"),
])
def test_a_bad_sidecar_is_one_line_naming_it(tmp_path: Path, meta: dict, message: str) -> None:
    path = _sidecar(tmp_path, **meta)
    with pytest.raises(ConfigError, match=message) as info:
        open_token_file(path)
    assert str(info.value).startswith(f"token file sidecar {sidecar_path(path)}: ") and "\n" not in str(info.value)
    sidecar_path(path).write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds list, not an object"):
        open_token_file(path)


def test_a_sidecar_of_a_file_too_large_to_scan_is_checked_batch_by_batch(tmp_path: Path, monkeypatch) -> None:
    from peerline.distributed.config import RunConfig
    from peerline.distributed.data import token_file
    from peerline.distributed.data.token_feed import token_data

    monkeypatch.setattr(token_file, "VERIFY_IDS", 2)
    path = tmp_path / "t.bin"
    np.array([1, 2, 3, 9] * 8, dtype=np.uint16).tofile(path)
    sidecar_path(path).write_text(json.dumps({"dtype": "uint16", "vocab": 5, "count": 32, "max_id": 4}))
    assert not open_token_file(path).verified
    data = token_data(RunConfig(model="gpt", data=str(path), seq=4, micro_batch_size=2))
    inputs, labels = torch.empty(2, 4, dtype=torch.int64), torch.empty(2, 4, dtype=torch.int64)
    with pytest.raises(ConfigError, match=rf"token file {path} gave token id 9 into inputs in iteration 1, "
                                          rf"microbatch 0; the vocabulary is 5 \(ids 0..4\); its sidecar "):
        data.fill(inputs, labels, 0, 0)


def feeds(kind: str, vocab_size: int):
    """User feeds that break the contract in one way each (tests below and the reliability table)."""
    def fill(inputs: torch.Tensor, labels: torch.Tensor, iteration: int, global_mb: int):
        ids = torch.arange(inputs.numel()).reshape(inputs.shape) % vocab_size
        if kind == "returns floats":
            return torch.rand(inputs.shape) * vocab_size
        if kind == "floats in place":
            inputs.copy_(torch.rand(inputs.shape) * vocab_size)
            labels.copy_(torch.rand(inputs.shape) * vocab_size)
            return None
        if kind == "out of range":
            ids = ids + vocab_size
        if kind == "late out of range" and iteration == 2:
            ids = ids + vocab_size
        if kind == "short rows":
            inputs[:, :-1] = ids[:, :-1]
            labels[:, :-1] = ids[:, :-1]
            return None
        if kind == "raises":
            raise IndexError("no such shard")
        inputs.copy_(ids)
        labels.copy_(ids)
        return None
    return fill


@pytest.mark.parametrize("kind,message", [
    ("returns floats", r"data feed '.*' returned a float32 tensor \[2, 8\] instead of writing the ids into its "
                       r"inputs and labels tensors \(int64 \[2, 8\], ids 0..4095\) in place"),
    ("floats in place", r"data feed '.*' writes floats into inputs \([0-9.]+ on the first batch\), which int64 ids "
                        r"truncate silently"),
    ("out of range", r"data feed '.*' wrote token id 4111 into inputs on the first batch; the vocabulary is 4096 "
                     r"\(ids 0..4095\) by default: pass --vocab, or give the feed object a `vocab` attribute"),
    ("short rows", r"data feed '.*' left 2 of the 16 ids of inputs \(int64 \[2, 8\], ids 0..4095\) unwritten"),
    ("raises", r"data feed '.*' failed on the first batch: fill\(inputs, labels, iteration=0, global_mb=0\) raised "
               r"IndexError: no such shard"),
])
def test_a_bad_user_feed_is_one_line_naming_it_at_start(kind: str, message: str, monkeypatch) -> None:
    from functools import partial

    from peerline.distributed.config import RunConfig
    from peerline.distributed.data.token_feed import token_data

    module = type(sys.modules[__name__])("bad_feed_module")
    module.make = partial(feeds, kind)
    monkeypatch.setitem(sys.modules, "bad_feed_module", module)
    with pytest.raises(ConfigError, match=message) as info:
        token_data(RunConfig(model="gpt", data="bad_feed_module:make", seq=8, micro_batch_size=2))
    assert "\n" not in str(info.value) and "'bad_feed_module:make'" in str(info.value)


def test_a_user_feed_s_ids_are_checked_every_batch(monkeypatch) -> None:
    from functools import partial

    from peerline.distributed.config import RunConfig
    from peerline.distributed.data.token_feed import token_data

    module = type(sys.modules[__name__])("late_feed_module")
    module.make = partial(feeds, "late out of range")
    monkeypatch.setitem(sys.modules, "late_feed_module", module)
    data = token_data(RunConfig(model="gpt", data="late_feed_module:make", seq=8, micro_batch_size=2, vocab=50))
    inputs, labels = torch.empty(2, 8, dtype=torch.int64), torch.empty(2, 8, dtype=torch.int64)
    data.fill(inputs, labels, 1, 3)
    with pytest.raises(ConfigError, match=r"data feed 'late_feed_module:make' wrote token id 65 into inputs in "
                                          r"iteration 3, microbatch 3; the vocabulary is 50 \(ids 0..49\)$"):
        data.fill(inputs, labels, 2, 3)


def test_empty_data_is_refused() -> None:
    from peerline.distributed.config import RunConfig

    for data in ("", "  "):
        with pytest.raises(ConfigError, match="--data is empty: name the data .* a PATH such as . for this folder"):
            RunConfig(model="gpt", data=data)


def test_the_first_run_says_it_tokenizes_and_a_large_folder_says_it_is_read(corpus_dir: Path, tmp_path: Path,
                                                                              capsys, monkeypatch) -> None:
    text_tokens(str(corpus_dir), vocab_size=300, cache_root=tmp_path)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith(f"peerline: text data: tokenizing {corpus_dir} once (") \
        and out[0].endswith("; later runs read the cache"), out
    assert out[1].startswith("peerline: text data: ") and " tokens cached in " in out[1], out
    text_tokens(str(corpus_dir), vocab_size=300, cache_root=tmp_path)
    assert capsys.readouterr().out == ""  # the cache: nothing to say
    monkeypatch.setattr(tokenizer_mod, "LARGE_TEXT_BYTES", 10)
    text_tokens(str(corpus_dir), vocab_size=300, cache_root=tmp_path)
    assert capsys.readouterr().out.startswith("peerline: text data: reading 3 text files (0 MB) of ")
