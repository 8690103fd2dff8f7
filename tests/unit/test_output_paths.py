"""Every output path is checked before the first iteration (observe/record.py `check_outputs`): a missing folder,
/proc, a folder given as a file path or a file given as a folder is one ConfigError line (the entry point: exit 2)."""

from __future__ import annotations

import pytest

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.observe.record import check_outputs

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
