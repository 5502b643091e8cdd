"""Writing a plan's files all at once: everything is rendered first, written into a temporary directory
beside --out, and only then moved into place, so a failing run leaves no file behind."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from planner.accelerate import accelerate_yaml
from planner.errors import PlanError
from planner.filemode import permissions
from planner.report.planmd import plan_markdown
from planner.slurm import slurm_script

PLAN_FILES = ("plan.json", "plan.md", "memory.png", "accelerate_config.yaml", "launch.slurm")
MEMORY_CHART = "memory.png"


def package_version() -> str:
    """dit-accel's version: the installed package's metadata, else the source tree's pyproject.toml."""
    try:
        return importlib.metadata.version("dit-accel")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = (
            re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
            if pyproject.is_file()
            else None
        )
        return found.group(1) if found else "unknown"


def provenance(command: str | None = None) -> dict:
    """What plan.md records about the run that wrote it: the command line, the version, the date (UTC)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    made = {"version": package_version(), "date": now}
    if command is not None:
        made["command"] = command
    return made


def render_files(plan: dict, command: str | None = None, chart: bool = True) -> dict[str, str | bytes]:
    """File name -> contents (text, or the chart's bytes). The SLURM script only for multi-node plans;
    the memory chart (Pillow) unless `chart` is False."""
    files = {
        "plan.json": json.dumps(plan, indent=2) + "\n",
        "plan.md": plan_markdown(plan, provenance(command), MEMORY_CHART if chart else None),
        "accelerate_config.yaml": accelerate_yaml(plan),
    }
    if chart:
        from planner.memorychart import memory_chart

        files[MEMORY_CHART] = memory_chart(plan)
    if plan["cluster"]["nodes"] > 1:
        files["launch.slurm"] = slurm_script(plan)
    return files


def check_out_dir(out: str | os.PathLike) -> Path:
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise PlanError(f"--out {out} is a file: give a directory for the plan's files")
    return path


def write_plan_dir(
    plan: dict, out: str | os.PathLike, command: str | None = None, chart: bool = True
) -> list[Path]:
    """Write the plan's files into `out`, replacing any earlier plan's files there (others are left alone).
    `command`: the command line plan.md shows at its top."""
    out = check_out_dir(out)
    files = render_files(plan, command, chart)  # render everything before touching the disk
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    try:
        for name, content in files.items():
            if isinstance(content, bytes):
                (staging / name).write_bytes(content)
            else:
                (staging / name).write_text(content)
        if (staging / "launch.slurm").exists():
            os.chmod(staging / "launch.slurm", permissions(0o777))
        os.chmod(staging, permissions(0o777))  # the folder a new --out becomes: not mkdtemp's 0700
        if not out.exists():
            os.replace(staging, out)
        else:
            for name in files:
                os.replace(staging / name, out / name)
            for stale in set(PLAN_FILES) - set(files):  # e.g. launch.slurm of an earlier multi-node plan
                if (out / stale).is_file():
                    (out / stale).unlink()
            staging.rmdir()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [out / name for name in files]


def check_file_path(path: str | os.PathLike) -> Path:
    """A --plot FILE can be written: not a directory, in a directory that exists."""
    path = Path(path)
    if path.is_dir():
        raise PlanError(f"--plot {path} is a directory: give a file name such as sweep.png")
    if not path.absolute().parent.is_dir():
        raise PlanError(f"--plot {path}: the directory {path.absolute().parent} does not exist")
    return path


def write_file_atomically(path: str | os.PathLike, content: bytes) -> Path:
    """One file (a --plot chart) written beside its place and moved there: never half-written."""
    path = check_file_path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.absolute().parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(content)
        os.chmod(temporary, permissions(0o666))  # as a plain open() would make it, not mkstemp's 0600
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
