"""Token files: a flat array of token ids on disk, read as a NumPy memmap.

The layout is nanoGPT's and Megatron's `.bin`: raw little-endian uint16 ids (uint32 when the vocabulary does not
fit 16 bits), no header. peerline writes a small sidecar `<name>.json` beside it (dtype, vocab, count, largest id,
source digest); a `.bin` made elsewhere has none, and then the dtype comes from the caller.

Every write goes to a temporary file in the same folder and is renamed into place (os.replace), so a reader never
sees half a file; the sidecar is written last and marks the token file complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from peerline.distributed.config import ConfigError
from peerline.files import atomic_write

TOKEN_DTYPES = ("uint16", "uint32")
_SCAN_CHUNK = 1 << 26  # ids per step when scanning a large file for its largest id
VERIFY_IDS = 1 << 28  # a sidecar's max_id is checked against the file up to this many ids (a fraction of a second)
SIDECAR_KEYS = ("dtype", "vocab", "count", "max_id")


@dataclass(frozen=True)
class TokenFile:
    """An opened token file: `tokens` is a read-only 1-D memmap; `vocab` bounds every id in it. `verified`: its
    largest id was read from the file itself, not only from its sidecar."""

    path: Path
    tokens: np.ndarray
    vocab: int
    eot_id: int | None = None
    verified: bool = True

    def __len__(self) -> int:
        return len(self.tokens)


def sidecar_path(path: Path) -> Path:
    """The sidecar of a token file: tokens.bin -> tokens.json."""
    return Path(path).with_suffix(".json")


def token_dtype_for(vocab: int) -> np.dtype:
    """uint16 while every id of the vocabulary fits 16 bits, else uint32 (little-endian, as nanoGPT writes)."""
    return np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")


def write_sidecar(path: Path, meta: dict[str, Any]) -> None:
    """Write the token file's sidecar atomically."""
    atomic_write(sidecar_path(path), lambda f: f.write(json.dumps(meta, indent=1, sort_keys=True).encode()))


def write_token_file(path: Path, tokens: np.ndarray, *, vocab: int, source_digest: str = "",
                     eot_id: int | None = None) -> TokenFile:
    """Write `tokens` as a token file with its sidecar (both atomically) and open it."""
    dtype = token_dtype_for(vocab)
    tokens = np.asarray(tokens)
    if len(tokens) and int(tokens.max()) >= vocab:
        raise ConfigError(f"token id {int(tokens.max())} >= vocab {vocab}")
    atomic_write(Path(path), lambda f: f.write(tokens.astype(dtype).tobytes()))
    write_sidecar(Path(path), {"dtype": dtype.name, "vocab": vocab, "count": len(tokens), "eot_id": eot_id,
                               "max_id": int(tokens.max()) if len(tokens) else -1, "source_digest": source_digest})
    return open_token_file(path)


def _largest_id(tokens: np.ndarray) -> int:
    """The largest id in a (possibly huge) memmap, scanned in chunks; -1 when empty."""
    largest = -1
    for i in range(0, len(tokens), _SCAN_CHUNK):
        largest = max(largest, int(tokens[i:i + _SCAN_CHUNK].max()))
    return largest


def _memmap(path: Path, dtype: np.dtype) -> np.ndarray:
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(f"token file {path}: {size} bytes is not a whole number of {dtype.name} ids")
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _read_sidecar(path: Path) -> dict[str, Any] | None:
    side = sidecar_path(path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"token file sidecar {side} is unreadable: {exc}") from None
    check_sidecar(meta, side)
    return meta


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_sidecar(meta: object, side: Path) -> None:
    """ConfigError naming the sidecar when it is not what write_token_file writes: an object with dtype (uint16
    or uint32), vocab (an integer whose ids fit that dtype), count (>= 0), max_id (-1 when empty, below vocab) and
    an optional eot_id (an id of the vocabulary)."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"token file sidecar {side}: {what}")

    if not isinstance(meta, dict):
        raise bad(f"holds {type(meta).__name__}, not an object with {', '.join(SIDECAR_KEYS)}")
    missing = [k for k in SIDECAR_KEYS if k not in meta]
    if missing:
        raise bad(f"lacks {', '.join(missing)} (a sidecar holds {', '.join(SIDECAR_KEYS)}); delete it to read the "
                  ".bin as plain uint16 ids")
    dtype, vocab, count, max_id = (meta[k] for k in SIDECAR_KEYS)
    if dtype not in TOKEN_DTYPES:
        raise bad(f"dtype is {dtype!r}; token ids are {' or '.join(TOKEN_DTYPES)}")
    limit = 1 << (16 if dtype == "uint16" else 32)
    if not _is_int(vocab) or not 1 <= vocab <= limit:
        raise bad(f"vocab is {vocab!r}; it must be an integer from 1 to {limit} ({dtype} ids)")
    if not _is_int(count) or count < 0:
        raise bad(f"count is {count!r}; it must be an integer >= 0")
    if not _is_int(max_id) or not -1 <= max_id < vocab:
        raise bad(f"max_id is {max_id!r}; it must be an integer from -1 (no ids) to vocab - 1 = {vocab - 1}")
    eot = meta.get("eot_id")
    if eot is not None and (not _is_int(eot) or not 0 <= eot < vocab):
        raise bad(f"eot_id is {eot!r}; it must be an id below vocab {vocab}, or null")


def open_token_file(path: str | Path, *, dtype: str = "uint16", vocab: int | None = None) -> TokenFile:
    """Open a token file. With a sidecar its dtype and vocabulary are used (`dtype` is ignored); without one
    (a nanoGPT-style .bin) the ids are read as `dtype` and the file is scanned once for its largest id. `vocab`
    (the model's) must exceed every id; when None, the sidecar's vocabulary or the largest id + 1."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"token file {path} does not exist")
    meta = _read_sidecar(path)
    if meta is None:
        if dtype not in TOKEN_DTYPES:
            raise ConfigError(f"token file dtype {dtype!r}: choose one of {', '.join(TOKEN_DTYPES)}")
        if vocab is not None and dtype == "uint16" and vocab > 1 << 16:
            raise ConfigError(f"vocab {vocab} does not fit uint16 token ids; is {path} a uint32 file?")
        tokens = _memmap(path, np.dtype(dtype).newbyteorder("<"))
        largest, eot_id, file_vocab = _largest_id(tokens), None, None
    else:
        tokens = _memmap(path, np.dtype(meta["dtype"]).newbyteorder("<"))
        if len(tokens) != meta["count"]:
            raise ConfigError(f"token file {path} holds {len(tokens)} ids, its sidecar {sidecar_path(path)} says "
                              f"{meta['count']}")
        largest, eot_id, file_vocab = _verified_max_id(path, tokens, meta["max_id"]), meta.get("eot_id"), meta["vocab"]
    vocab = vocab if vocab is not None else (file_vocab if file_vocab is not None else largest + 1)
    if largest >= vocab:
        raise ConfigError(f"token file {path} holds token id {largest} >= vocab {vocab}")
    return TokenFile(path=path, tokens=tokens, vocab=vocab, eot_id=eot_id,
                     verified=meta is None or len(tokens) <= VERIFY_IDS)


def _verified_max_id(path: Path, tokens: np.ndarray, max_id: int) -> int:
    """The sidecar's max_id, checked against the file when it is small enough to scan (VERIFY_IDS); a larger
    file's ids are checked batch by batch instead (data/feed_check.py)."""
    if len(tokens) > VERIFY_IDS:
        return max_id
    largest = _largest_id(tokens)
    if largest > max_id:
        raise ConfigError(f"token file sidecar {sidecar_path(path)}: max_id is {max_id}, but {path} holds id "
                          f"{largest}; fix max_id (or delete the sidecar to scan the file)")
    return max_id
