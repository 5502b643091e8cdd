"""Writing a plan's files all at once: everything is rendered first, written into a temporary directory
beside --out, and only then moved into place, so a failing run leaves no file behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from planner.accelerate import accelerate_yaml
from planner.errors import PlanError
from planner.report import plan_markdown
from planner.slurm import slurm_script

PLAN_FILES = ("plan.json", "plan.md", "accelerate_config.yaml", "launch.slurm")


def render_files(plan: dict) -> dict[str, str]:
    """File name -> contents. The SLURM script only for multi-node plans."""
    files = {
        "plan.json": json.dumps(plan, indent=2) + "\n",
        "plan.md": plan_markdown(plan),
        "accelerate_config.yaml": accelerate_yaml(plan),
    }
    if plan["cluster"]["nodes"] > 1:
        files["launch.slurm"] = slurm_script(plan)
    return files


def check_out_dir(out: str | os.PathLike) -> Path:
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise PlanError(f"--out {out} is a file: give a directory for the plan's files")
    return path


def write_plan_dir(plan: dict, out: str | os.PathLike) -> list[Path]:
    """Write the plan's files into `out`, replacing any earlier plan's files there (others are left alone)."""
    out = check_out_dir(out)
    files = render_files(plan)  # render everything before touching the disk
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    try:
        for name, text in files.items():
            (staging / name).write_text(text)
        if (staging / "launch.slurm").exists():
            os.chmod(staging / "launch.slurm", 0o755)
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
