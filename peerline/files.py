"""Files written so that readers see either the old content or the complete new one, never a part.

An output path that is a character device or a FIFO (/dev/null, /dev/stdout, a named pipe, a shell's `>(cmd)`) is
written into, never replaced: a rename over it would put a regular file in its place. Any other kind of file that
is not a regular file (a block device, a socket) is refused.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable. Some file systems refuse fsync on a directory: that is not an error."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


#: The kinds of special file that an output is written into (`special_kind`'s names).
WRITTEN_INTO = ("character device", "FIFO")
_KINDS = ((stat.S_ISCHR, "character device"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISBLK, "block device"),
          (stat.S_ISSOCK, "socket"))


def special_kind(path: Path) -> str | None:
    """What `path` is when it exists and is neither a regular file nor a folder (symbolic links followed):
    'character device', 'FIFO', 'block device', 'socket'; None otherwise."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((name for test, name in _KINDS if test(mode)), None)


def write_into(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call `write(f)` on `path` opened for writing as it is: a character device or a FIFO (a FIFO's open waits
    for its reader, as a shell's redirection does)."""
    with open(path, "wb") as f:
        write(f)
        f.flush()


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call `write(f)` on a temporary file beside `path`, flush it to disk, then rename it over `path` (over a
    symbolic link's target, so the link stays). A character device or FIFO at `path` is written into instead;
    another special file is an OSError (EINVAL)."""
    path = Path(path)
    if path.is_symlink():  # the link's target gets the new content; the link itself stays a link
        path = Path(os.path.realpath(path))
    kind = special_kind(path)
    if kind in WRITTEN_INTO:
        write_into(path, write)
        return
    if kind is not None:
        raise OSError(errno.EINVAL, f"{path} is a {kind}, not a file")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
