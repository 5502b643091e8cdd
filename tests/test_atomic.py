"""dit_accel.atomic: a failed write leaves the old file or folder untouched; what appears has umask permissions."""

import json
import os

import pytest

from dit_accel.atomic import (
    permissions,
    replace_folder,
    staged_folder,
    write_atomically,
    write_bytes_atomically,
    write_json_atomically,
)
from dit_accel.errors import UserError


def test_a_failed_file_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out" / "data.json"
    write_json_atomically(target, {"a": 1})  # makes the parent folder
    assert json.loads(target.read_text()) == {"a": 1} and target.read_text().endswith("\n")
    assert target.stat().st_mode & 0o777 == permissions(0o666)  # what open() gives, not mkstemp's 0600

    def half_then_crash(file):
        file.write(b'{"a": ')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, half_then_crash)
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in target.parent.iterdir()] == ["data.json"]
    write_bytes_atomically(target, b"new")
    assert target.read_bytes() == b"new"


def test_staged_folder_swaps_whole_folders_and_cleans_up_on_failure(tmp_path):
    out = tmp_path / "run"
    with staged_folder(out) as staging:
        (staging / "sub").mkdir()
        (staging / "sub" / "a.txt").write_text("old")
        os.chmod(staging / "sub", 0o700)
    assert (out / "sub" / "a.txt").read_text() == "old"
    assert (out / "sub").stat().st_mode & 0o777 == permissions(0o777)
    assert out.stat().st_mode & 0o777 == permissions(0o777)  # not mkdtemp's 0700

    with pytest.raises(UserError, match="not an empty folder.*--overwrite"):
        with staged_folder(out):
            pass
    with pytest.raises(RuntimeError):
        with staged_folder(out, overwrite=True) as staging:
            (staging / "b.txt").write_text("half")
            raise RuntimeError("killed")
    assert sorted(p.name for p in out.iterdir()) == ["sub"]  # the old folder, untouched
    with staged_folder(out, overwrite=True) as staging:
        (staging / "b.txt").write_text("new")
    assert [p.name for p in out.iterdir()] == ["b.txt"]  # replaced whole, not merged
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no staging or aside folder left behind


def test_replace_folder_over_an_empty_and_a_full_target(tmp_path):
    for existing in ([], ["old.txt"]):
        target = tmp_path / f"target{len(existing)}"
        target.mkdir()
        for name in existing:
            (target / name).write_text("old")
        staging = tmp_path / f"staging{len(existing)}"
        staging.mkdir()
        (staging / "new.txt").write_text("new")
        replace_folder(staging, target)
        assert [p.name for p in target.iterdir()] == ["new.txt"] and not staging.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target0", "target1"]
