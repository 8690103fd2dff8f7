"""Where text comes from: the default corpus every machine has without a download, or a user's files.

The default corpus is the Python standard library's own .py files (sysconfig's "stdlib" path; installed
packages, tests and codec tables left out), in sorted order, read up to a byte cap so tokenizing stays quick.
A user path is a folder (every non-hidden text file under it, sorted) or one text file. A document is one file;
its bytes are decoded as UTF-8 (undecodable bytes become U+FFFD), so the same files give the same text anywhere.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from peerline.distributed.config import ConfigError

DEFAULT_CORPUS = "text"
DEFAULT_STDLIB_CAP = 4_000_000  # bytes: trains and tokenizes in seconds on two CPU cores
# Folders of the stdlib path that are not the library's own code: installed packages, test suites, codec tables.
STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"})
_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class Corpus:
    """A sorted list of text files read up to `cap_bytes` (None: all): `documents()` yields one string per file,
    the last one cut at the cap."""

    name: str
    files: tuple[Path, ...]
    cap_bytes: int | None = None

    def documents(self) -> Iterator[str]:
        left = self.cap_bytes
        for path in self.files:
            data = path.read_bytes()
            if left is not None:
                data = data[:left]
                left -= len(data)
            yield data.decode("utf-8", errors="replace")
            if left == 0:
                return

    def size_bytes(self) -> int:
        """The bytes the documents are read from: the files' sizes, up to the cap."""
        total = sum(path.stat().st_size for path in self.files)
        return total if self.cap_bytes is None else min(total, self.cap_bytes)

    def digest(self) -> str:
        """SHA-256 of the documents' text (each length-prefixed): what the cached tokens depend on."""
        h = hashlib.sha256()
        for doc in self.documents():
            raw = doc.encode("utf-8")
            h.update(len(raw).to_bytes(8, "little"))
            h.update(raw)
        return h.hexdigest()


def stdlib_corpus(cap_bytes: int | None = DEFAULT_STDLIB_CAP) -> Corpus:
    """The standard library's .py files, sorted by path below the stdlib folder, capped at `cap_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in STDLIB_SKIP]  # pruned: site-packages alone can be huge
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    files = sorted(found, key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise ConfigError(f"text data: no .py files in the standard library folder {root}")
    return Corpus(name=f"python stdlib ({root})", files=tuple(files), cap_bytes=cap_bytes)


def is_text_file(path: Path) -> bool:
    """A non-empty file whose first bytes hold no NUL (git's test for binary files)."""
    try:
        with path.open("rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError:
        return False
    return bool(head) and b"\0" not in head


def folder_corpus(folder: Path, cap_bytes: int | None = None) -> Corpus:
    """Every non-hidden text file below `folder`, sorted by relative path."""
    candidates = (p for p in folder.rglob("*")
                  if not any(part.startswith(".") for part in p.relative_to(folder).parts) and p.is_file())
    files = sorted((p for p in candidates if is_text_file(p)), key=lambda p: p.relative_to(folder).as_posix())
    if not files:
        raise ConfigError(f"text data: no text files in folder {folder}")
    return Corpus(name=str(folder), files=tuple(files), cap_bytes=cap_bytes)


def path_corpus(path: str | Path, cap_bytes: int | None = None) -> Corpus:
    """The corpus of a user path: a folder of text files, or one text file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"text data: {path} does not exist")
    if path.is_dir():
        return folder_corpus(path, cap_bytes)
    if not is_text_file(path):
        raise ConfigError(f"text data: {path} is empty or not a text file")
    return Corpus(name=str(path), files=(path,), cap_bytes=cap_bytes)
