"""Atomic writes: every file and folder dit-accel makes appears whole or not at all.

A run may be killed at any moment (preemption, the OOM killer, Ctrl-C), and a reader may look while it
writes (a second rank, a rerun, an evaluator). So a file is written to a temporary name beside its target,
fsynced and renamed over it; a folder is filled under a temporary name and swapped in whole, the old one
moved aside first and removed only afterwards. And what appears gets the permissions a plain open() or
mkdir() would give (the umask), not the 0600/0700 of mkstemp/mkdtemp, which would hide a shared output from
a cluster's other users.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from dit_accel.errors import UserError
from planner.filemode import permissions


def write_atomically(path: str | os.PathLike, write_fn: Callable[[BinaryIO], None]) -> Path:
    """Call `write_fn(file)` on a temporary file beside `path`, fsync, then rename it to `path`: a reader (or a
    rerun after a kill) sees the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(handle, permissions(0o666))
        with os.fdopen(handle, "wb") as tmp_file:
            write_fn(tmp_file)
            tmp_file.flush()
            os.fsync(tmp_file.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path


def write_bytes_atomically(path: str | os.PathLike, payload: bytes) -> Path:
    return write_atomically(path, lambda file: file.write(payload))


def write_json_atomically(path: str | os.PathLike, data) -> Path:
    """JSON, indented, with a final newline."""
    return write_bytes_atomically(path, (json.dumps(data, indent=2) + "\n").encode())


def replace_folder(staging: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Move the finished folder `staging` to `target`. An old non-empty `target` is moved aside first and removed
    only after the new one is in place, so at no moment does `target` hold a mix of old and new files."""
    staging, target = Path(staging), Path(target)
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    if not target.exists():
        os.replace(staging, target)
        return target
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    os.replace(target, aside / target.name)
    os.replace(staging, target)
    shutil.rmtree(aside, ignore_errors=True)
    return target


def set_umask_permissions(folder: str | os.PathLike) -> None:
    """Give a finished folder, and everything in it, the modes a plain mkdir/open would have."""
    os.chmod(folder, permissions(0o777))
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), permissions(0o777))
        for name in files:
            os.chmod(os.path.join(root, name), permissions(0o666))


@contextlib.contextmanager
def staged_folder(out_dir: str | os.PathLike, overwrite: bool = False):
    """Yield an empty folder beside `out_dir` to fill; when the block succeeds it gets umask permissions and
    replaces `out_dir` whole (`replace_folder`), when it fails it is deleted. A reader never sees half a folder.
    A non-empty `out_dir` is refused unless `overwrite`."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not overwrite)):
        raise UserError(
            f"{out_dir} exists and is not an empty folder: choose a new --out or pass --overwrite"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield staging
        set_umask_permissions(staging)
        replace_folder(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
