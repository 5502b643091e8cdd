"""Output checks: room on disk for the checkpoints the run will keep, and permission to write there.

`disk_usage` is a parameter (shutil.disk_usage by default) so a test can simulate a tiny quota.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from dit_accel.doctor.checks import Check, Status, failed, gib, passed, warned
from dit_accel.doctor.plan import PlanFacts

GROUP = "output"
WEIGHT_BYTES = 4  # fp32 master weights
EMA_BYTES = 4  # fp32 EMA copy
ADAM_BYTES = 8  # AdamW's two fp32 moments
DISK_WARN_FACTOR = 1.5  # less than 1.5x the need leaves no room for logs, samples and exports


def checkpoint_bytes(plan: PlanFacts) -> int:
    """One checkpoint: weights + EMA + AdamW states, all fp32, whatever the training precision."""
    per_param = WEIGHT_BYTES + ADAM_BYTES + (EMA_BYTES if plan.ema else 0)
    return plan.params_trainable * per_param


def _existing_ancestor(path: Path) -> Path:
    """The output folder may not exist yet: its nearest existing ancestor is where the bytes will land."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(
    plan: PlanFacts, output_dir: Path, keep_last: int, disk_usage: Callable[[str], tuple] = shutil.disk_usage
) -> Check:
    name = "disk space"
    where = _existing_ancestor(output_dir)
    free_bytes = disk_usage(str(where)).free
    from dit_accel.run.checkpoint import complete_checkpoints

    one = checkpoint_bytes(plan)
    # the trainer commits the new checkpoint before rotating, so keep_last + 1 exist for a moment;
    # checkpoints already in the run folder (a resume) are already off the free space
    existing = len(complete_checkpoints(output_dir)) if output_dir.is_dir() else 0
    need = one * max(1, keep_last + 1 - existing)
    what = (
        f"{gib(free_bytes)} free at {where}; a checkpoint of {plan.model_name} (weights + EMA + AdamW, fp32) is "
        f"{gib(one)}, keeping {keep_last} needs {gib(need)} more while the next one is written"
        + (f" ({existing} already there)" if existing else "")
    )
    fix = "free space, point --output-dir at a larger disk, or keep fewer checkpoints"
    if free_bytes < need:
        return failed(GROUP, name, what, fix)
    if free_bytes < DISK_WARN_FACTOR * need:
        return warned(GROUP, name, what + "; little room left for logs and samples", fix)
    return passed(GROUP, name, what)


def check_writable(output_dir: Path) -> Check:
    """Create and delete a temporary file where the run will write: the first checkpoint must not be the test."""
    name = "write permission"
    where = _existing_ancestor(output_dir)
    fix = f"pick an --output-dir you can write to, or fix the permissions of {where}"
    if not where.is_dir():
        return failed(GROUP, name, f"{where} is a file, not a folder, so {output_dir} cannot be created", fix)
    try:
        handle, temp_path = tempfile.mkstemp(dir=where, prefix=".dit-doctor-")
        os.close(handle)
        os.remove(temp_path)
    except OSError as error:
        return failed(GROUP, name, f"cannot write in {where}: {error.strerror or error}", fix)
    state = "exists" if output_dir.exists() else f"will be created in {where}"
    return passed(GROUP, name, f"{output_dir} {state}; writing a file there works")


def check_output(
    plan: PlanFacts, output_dir: Path, keep_last: int, disk_usage: Callable[[str], tuple] = shutil.disk_usage
) -> list[Check]:
    writable = check_writable(output_dir)
    if writable.status is Status.FAIL and not _existing_ancestor(output_dir).is_dir():
        return [writable]
    return [check_disk(plan, output_dir, keep_last, disk_usage), writable]
