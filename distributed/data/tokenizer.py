"""Text -> tokens, once: a byte-level BPE trained on the corpus with Hugging Face `tokenizers`, and the corpus
encoded into a token file, both cached.

The cache folder is `<cache_root>/<digest>/` (default root ~/.cache/peerline/text), the digest covering the
corpus text, the vocabulary size and the cache format, and holds tokenizer.json, tokens.bin and its sidecar
tokens.json. Every document is followed by <|endoftext|>. Ranks that start together share the work: an
exclusive file lock (fcntl) lets one process tokenize while the others wait, every file is written to a
temporary name and renamed into place, and the sidecar, written last, marks the cache complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from peerline.distributed.config import ConfigError
from peerline.distributed.data.corpus import DEFAULT_CORPUS, DEFAULT_STDLIB_CAP, Corpus, path_corpus, stdlib_corpus
from peerline.distributed.data.token_file import (
    TokenFile,
    atomic_write,
    open_token_file,
    sidecar_path,
    token_dtype_for,
    write_sidecar,
)

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 4096
CACHE_FORMAT = 1  # part of the digest: a change of the cached layout gets a new folder
_ENCODE_BATCH = 64  # documents per encode call: keeps memory flat on a large folder
LARGE_TEXT_BYTES = 100_000_000  # a user's text above this size gets a line before it is read


def default_cache_root() -> Path:
    return Path.home() / ".cache" / "peerline" / "text"


def train_tokenizer(documents: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder, all 256 bytes in the alphabet, <|endoftext|> as id
    0) trained on `documents`. Its vocabulary may come out smaller than `vocab_size` on a small corpus."""
    if vocab_size < 257:
        raise ConfigError(f"tokenizer vocab size {vocab_size} must be at least 257 (256 bytes and <|endoftext|>)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def encode_documents(tokenizer: Tokenizer, documents: Iterable[str]) -> Iterator[np.ndarray]:
    """The ids of each batch of documents, each document followed by <|endoftext|>, as int64 arrays."""
    eot = tokenizer.token_to_id(EOT)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no character offsets: faster
    batch: list[str] = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == _ENCODE_BATCH:
            yield _join(encode(batch), eot)
            batch = []
    if batch:
        yield _join(encode(batch), eot)


def _join(encodings: list, eot: int) -> np.ndarray:
    parts = [np.asarray(e.ids + [eot], dtype=np.int64) for e in encodings]
    return np.concatenate(parts)


def cache_dir_for(corpus: Corpus, vocab_size: int, cache_root: Path | None = None) -> tuple[Path, str]:
    """The corpus's cache folder and its digest (text, vocabulary size and cache format)."""
    digest = hashlib.sha256(f"{corpus.digest()}:{vocab_size}:{CACHE_FORMAT}".encode()).hexdigest()
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    return root / digest[:16], digest


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("text data: another process is tokenizing into %s; waiting", lock_path.parent)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_cache(corpus: Corpus, folder: Path, vocab_size: int, digest: str) -> None:
    """Train the tokenizer, encode the corpus into tokens.bin and write the sidecar last. Says so on stdout:
    this is the first run's pause (seconds for the default text, minutes for a large folder)."""
    started = time.monotonic()
    print(f"peerline: text data: tokenizing {corpus.name} once ({corpus.size_bytes() / 1e6:.1f} MB; a "
          f"{vocab_size}-token byte-level BPE) into {folder}; later runs read the cache", flush=True)
    tokenizer = train_tokenizer(corpus.documents(), vocab_size)
    vocab = tokenizer.get_vocab_size()
    atomic_write(folder / "tokenizer.json", lambda f: f.write(tokenizer.to_str().encode()))
    dtype = token_dtype_for(vocab)
    count, largest = 0, -1

    def write_tokens(f) -> None:
        nonlocal count, largest
        for ids in encode_documents(tokenizer, corpus.documents()):
            f.write(ids.astype(dtype).tobytes())
            count, largest = count + len(ids), max(largest, int(ids.max()))

    atomic_write(folder / "tokens.bin", write_tokens)
    write_sidecar(folder / "tokens.bin", {"dtype": dtype.name, "vocab": vocab, "count": count, "max_id": largest,
                                          "eot_id": tokenizer.token_to_id(EOT), "source_digest": digest,
                                          "source": corpus.name, "format": CACHE_FORMAT})
    print(f"peerline: text data: {count:,} tokens cached in {time.monotonic() - started:.1f} s", flush=True)


def tokenize_corpus(corpus: Corpus, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                    cache_root: Path | None = None) -> TokenFile:
    """The corpus's token file, tokenized on the first call and read from the cache afterwards."""
    folder, digest = cache_dir_for(corpus, vocab_size, cache_root)
    tokens_path = folder / "tokens.bin"
    if not sidecar_path(tokens_path).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with _exclusive(folder / ".lock"):
            if not sidecar_path(tokens_path).is_file():  # another process may have finished while we waited
                _build_cache(corpus, folder, vocab_size, digest)
    return open_token_file(tokens_path)


def load_tokenizer(token_file: TokenFile) -> Tokenizer:
    """The tokenizer cached beside a token file (to decode samples)."""
    path = token_file.path.parent / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"no tokenizer.json beside {token_file.path}")
    return Tokenizer.from_file(str(path))


def text_tokens(source: str | None = None, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                cache_root: Path | None = None, cap_bytes: int | None = None, dtype: str = "uint16",
                vocab: int | None = None) -> TokenFile:
    """The tokens of a data source: None or "text" = the stdlib corpus (capped at DEFAULT_STDLIB_CAP unless
    `cap_bytes` says otherwise), a `.bin` path = an existing token file (read as `dtype` when it has no
    sidecar), any other path = a folder of text files or one text file. `vocab` (the model's) must exceed every
    id."""
    if source in (None, DEFAULT_CORPUS):
        corpus = stdlib_corpus(DEFAULT_STDLIB_CAP if cap_bytes is None else cap_bytes)
    elif Path(source).suffix == ".bin":
        return open_token_file(Path(source).expanduser(), dtype=dtype, vocab=vocab)
    else:
        corpus = path_corpus(source, cap_bytes)
        if corpus.size_bytes() > LARGE_TEXT_BYTES:  # read whole at every start, for the cache's digest
            print(f"peerline: text data: reading {len(corpus.files):,} text files ({corpus.size_bytes() / 1e6:,.0f} "
                  f"MB) of {corpus.name} to find their tokens (a .bin token file skips this)", flush=True)
    token_file = tokenize_corpus(corpus, vocab_size=vocab_size, cache_root=cache_root)
    return token_file if vocab is None else open_token_file(token_file.path, vocab=vocab)
