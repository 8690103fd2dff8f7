"""Every output path is checked before the first iteration (observe/record.py `check_outputs`): a missing folder,
/proc, a folder given as a file path or a file given as a folder is one ConfigError line (the entry point: exit 2).
A character device or FIFO is written into, never replaced by a rename (peerline/files.py `atomic_write`)."""

from __future__ import annotations

import os
import socket
import stat
import threading

import pytest

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.observe.record import check_outputs
from peerline.files import atomic_write

pytestmark = pytest.mark.timeout(60)

FILES = ("json", "metrics_jsonl", "timeline")
FOLDERS = ("save", "profile")


@pytest.mark.parametrize("field", FILES + FOLDERS)
@pytest.mark.parametrize("where", ["missing_parent", "proc", "folder_as_file", "file_as_folder"])
def test_bad_output_paths_are_one_line(tmp_path, field, where):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    path = {"missing_parent": tmp_path / "no" / "such" / "out", "proc": "/proc/peerline-out",
            "folder_as_file": tmp_path, "file_as_folder": a_file / "out"}[where]
    if where == "folder_as_file" and field in FOLDERS:
        path = a_file  # a folder flag given a file
    if where == "folder_as_file" and field == "timeline":
        (tmp_path / "t.png").mkdir()  # --timeline is a stem: its PNG's name is a folder
        path = tmp_path / "t"
    if where == "missing_parent" and field in FOLDERS:
        pytest.skip("a folder output is created with its parents")
    with pytest.raises(ConfigError) as e:
        check_outputs(RunConfig(**{field: str(path)}))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--{field.replace('_', '-')} "), msg


@pytest.mark.parametrize("field", FILES + FOLDERS)
def test_good_output_paths_pass_and_leave_nothing_behind(tmp_path, field):
    target = tmp_path / "sub" / "out" if field in FOLDERS else tmp_path / "out"
    check_outputs(RunConfig(**{field: str(target)}))
    leftovers = [p for p in tmp_path.rglob("*") if p.name.startswith(".peerline-probe-")]
    assert leftovers == []


# ---- outputs that are not regular files: written into (character devices, FIFOs), never replaced


def _is_char_device(path) -> bool:
    return stat.S_ISCHR(os.stat(path).st_mode)


@pytest.fixture
def dev_null_link(tmp_path):
    """A symbolic link to /dev/null in tmp_path (the real /dev/null is never named): replacing the link by a regular
    file is what a rename over the output would do."""
    link = tmp_path / "null"
    link.symlink_to("/dev/null")
    yield link
    assert _is_char_device("/dev/null")


def _fifo_reader(path) -> tuple[threading.Thread, list[bytes]]:
    """A thread that opens the FIFO `path` for reading and reads it to its end."""
    got: list[bytes] = []

    def read() -> None:
        with open(path, "rb") as f:
            got.append(f.read())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, got


def test_atomic_write_writes_into_a_link_to_a_character_device(dev_null_link):
    atomic_write(dev_null_link, lambda f: f.write(b"record"))
    assert dev_null_link.is_symlink() and _is_char_device(dev_null_link)
    assert [p.name for p in dev_null_link.parent.iterdir()] == ["null"]  # no temporary file beside it


def test_atomic_write_writes_into_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    thread, got = _fifo_reader(fifo)
    atomic_write(fifo, lambda f: f.write(b"record"))
    thread.join(10)
    assert got == [b"record"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_atomic_write_refuses_a_socket(tmp_path):
    path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with pytest.raises(OSError, match="is a socket, not a file"):
            atomic_write(path, lambda f: f.write(b"record"))
        assert stat.S_ISSOCK(os.stat(path).st_mode)


@pytest.mark.parametrize("field", ["json", "metrics_jsonl"])
def test_a_character_device_or_fifo_output_passes_the_start_up_check(tmp_path, dev_null_link, field):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in (dev_null_link, fifo):
        check_outputs(RunConfig(**{field: str(path)}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null", "pipe"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and _is_char_device(dev_null_link)


@pytest.mark.parametrize("field", ["json", "metrics_jsonl"])
def test_a_device_that_takes_no_write_or_a_socket_is_one_line(tmp_path, field):
    full = tmp_path / "full"
    full.symlink_to("/dev/full")
    flag = f"--{field.replace('_', '-')}"
    with pytest.raises(ConfigError, match=f"^{flag} {full}: cannot write into this character device "
                                          r"\(No space left on device\)$"):
        check_outputs(RunConfig(**{field: str(full)}))
    path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with pytest.raises(ConfigError, match=f"^{flag} {path} is a socket: give a file name"):
            check_outputs(RunConfig(**{field: str(path)}))


def test_a_link_to_a_regular_file_keeps_its_link_and_the_target_gets_the_content(tmp_path):
    from peerline.files import atomic_write

    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write(link, lambda f: f.write(b"new"))
    assert link.is_symlink() and target.read_text() == "new"
