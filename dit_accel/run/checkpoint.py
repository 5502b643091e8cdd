"""Checkpoints that count only once complete: commit, rotate and resume around `accelerator.save_state`.

`accelerator.save_state` writes into its folder in place, and with automatic naming it prunes old
checkpoints BEFORE the new one exists, so a crash mid-write can leave no usable checkpoint at all. Here
every rank writes into `checkpoints/step_NNNNNNNN.tmp/`; once all ranks are done the main process fsyncs
every file, writes the `COMPLETE` marker, renames the folder to `step_NNNNNNNN/` and only then deletes the
oldest complete checkpoints beyond `keep_last`. A folder without the marker is never loaded.

The marker also records the checkpoint's lineage and a manifest of its files (`dit_accel.run.lineage`): rotation
and `--resume auto` follow the current timeline, not the highest step, and a damaged checkpoint is found and
named before it is loaded. A save that runs out of disk space removes its partial folder on every rank's error
path and stops with one line naming the disk and the space needed.

Layout of one checkpoint folder (see docs/training.md):

    model.safetensors          the trained weights (accelerate's save_state)
    optimizer.bin              AdamW state (accelerate; read back with torch's weights-only unpickler)
    pytorch_model_fsdp_0/      sharded plans (FSDP2) instead of the two above: weights and AdamW state as
    optimizer_0/               torch.distributed.checkpoint folders, each rank writing its own shards
    lr_scheduler.json          the lr scheduler's state (not registered with accelerate, which would pickle it
                               and unpickle it with weights_only=False: run.pickles; older checkpoints hold
                               custom_checkpoint_0.pkl instead, read weights-only)
    scaler.pt                  the fp16 grad scaler, only with fp16 (accelerate)
    random_states_R.pkl        python/numpy/torch RNG states of rank R, and accelerate's micro-step counter
                               (each rank reads its own weights-only before the load: run.pickles)
    ema.safetensors            fp32 EMA weights, keyed like the unwrapped model's parameters (full tensors
                               even when sharded: gathered at save time, so sampling needs no process group)
    train_state.json           step, applied/skipped steps, data position, world size, global batch
    plan.json                  the plan this run trained with
    train_config.json          the run's TrainConfig
    dit_accel.json             the network's spec and timestep shift (0 for weights from an original DiT)
    metrics.jsonl              the run's metrics.jsonl as it was at this step: the timeline a resume restores
    COMPLETE                   written last; its presence is what makes the folder a checkpoint: step,
                               world size, id, parent, sequence and the manifest (size, sha256 per file)

A complete checkpoint of an abandoned branch whose step the current timeline writes again is moved aside to
`step_NNNNNNNN.branch-ID` (ID: the start of its marker's id) and kept, like the rest of its branch.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path

from dit_accel.atomic import replace_folder, write_bytes_atomically, write_json_atomically
from dit_accel.distributed.consensus import agreed, gathered, main_decides
from dit_accel.errors import UserError
from dit_accel.run import lineage, records
from dit_accel.run.pickles import (
    LEGACY_SCHEDULER_STATE,
    SCHEDULER_STATE,
    check_before_load,
    load_weights_only,
    refused,
    scheduler_state_json,
)
from dit_accel.run.sharded import check_sharded_saves
from planner.filemode import permissions

log = logging.getLogger("dit_accel.train")

CHECKPOINTS = "checkpoints"
COMPLETE = lineage.MARKER
TMP_SUFFIX = ".tmp"
TRAIN_STATE = "train_state.json"
EMA_WEIGHTS = "ema.safetensors"
MODEL_WEIGHTS = "model.safetensors"
SHARDED_MODEL = "pytorch_model_fsdp_0"  # accelerate's FSDP SHARDED_STATE_DICT folder for model 0
PLAN = "plan.json"
TRAIN_CONFIG = (
    "train_config.json"  # the run's TrainConfig (train.config), in the run folder and every checkpoint
)
# step_N, or a kept branch's step_N.branch-ID (older versions named some `step_N.branch-step_000`)
_NAME = re.compile(r"^step_(\d{8,})(\.branch-[0-9a-z_]+)?$")
METRICS = "metrics.jsonl"  # RUN/metrics.jsonl, and its copy in each checkpoint
CONTINUE = "continue"  # save_checkpoint's default parent: the folder's most recently written checkpoint


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def is_complete(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and _NAME.match(path.name) is not None and (path / COMPLETE).is_file()


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint of a run, on any branch, oldest step first. Partial
    folders are skipped."""
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match and is_complete(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def current_lineage(run_dir: str | Path) -> list[lineage.Node]:
    """The current timeline: the most recently written complete checkpoint and its ancestors, newest first."""
    nodes = lineage.nodes(complete_checkpoints(run_dir))
    return lineage.chain(nodes, lineage.head(nodes))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The tip of the current timeline (the most recently written checkpoint, not the highest step)."""
    line = current_lineage(run_dir)
    return line[0].path if line else None


def abandoned_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints on other branches than the current timeline: kept until the user removes them."""
    nodes = lineage.nodes(complete_checkpoints(run_dir))
    current = {node.id for node in lineage.chain(nodes, lineage.head(nodes))}
    return [node.path for node in nodes if node.id not in current]


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, a run folder (its newest complete checkpoint) or a run's checkpoints/ folder."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist: pass a checkpoint folder or a run folder")
    if _NAME.match(path.name):
        if not is_complete(path):
            raise UserError(
                f"checkpoint {path} is incomplete (no {COMPLETE} marker",
                "the run stopped while writing it): use an older one or --resume auto",
            )
        return path
    run_dir = path.parent if path.name == CHECKPOINTS else path
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise UserError(f"no complete checkpoint under {run_dir}: train first, or pass a checkpoint folder")
    return latest


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """`--resume auto`: the newest intact checkpoint of the current timeline (a damaged one is skipped with a
    warning naming the file), or None to start fresh. `--resume PATH`: that checkpoint, refused in one line
    when damaged. Reads every file's sha256: call it on the main process (`consensus.main_decides`)."""
    if resume is None:
        return None
    if resume != "auto":
        checkpoint = resolve_checkpoint(resume)
        problem = lineage.damage(checkpoint)
        if problem:
            raise UserError(
                f"checkpoint {checkpoint} is damaged: {problem}",
                "resume from an older checkpoint (--resume auto skips damaged ones) or restore the file",
            )
        return checkpoint
    nodes = lineage.nodes(complete_checkpoints(output_dir))
    line = lineage.chain(nodes, lineage.head(nodes))
    newest_problem = None
    for node in [node for node in nodes if node.damaged and node not in line] + line:
        problem = lineage.damage(node.path)  # a damaged marker first: its checkpoint is on no timeline
        if problem is None:
            return node.path
        log.warning(f"--resume auto skips damaged checkpoint {node.path.name}: {problem}")
        newest_problem = newest_problem or problem
    if newest_problem:  # never start over at step 0 silently in a folder of damaged checkpoints
        raise UserError(
            f"every checkpoint of the current timeline in {checkpoints_dir(output_dir)} is damaged (newest: "
            f"{newest_problem})",
            "restore the files, pass --resume PATH to another checkpoint, or use another --output-dir",
        )
    return None


def read_train_state(checkpoint: str | Path) -> dict:
    """The checkpoint's train_state.json, its counts checked (run.records), its step the marker's."""
    state = records.read_train_state(Path(checkpoint) / TRAIN_STATE)
    marked = lineage.read_marker(Path(checkpoint)).get("step") if is_complete(checkpoint) else None
    if isinstance(marked, int) and marked != state["step"]:
        raise UserError(
            f"{Path(checkpoint) / TRAIN_STATE} says step {state['step']}, its {COMPLETE} marker step {marked}",
            "resume from a checkpoint this trainer wrote (--resume auto skips none; pass an older --resume PATH)",
        )
    return state


def read_train_config(checkpoint: str | Path) -> dict:
    """The TrainConfig a checkpoint was written with ({} for one without train_config.json), as an object."""
    path = Path(checkpoint) / TRAIN_CONFIG
    return records.read_json_object(path) if path.is_file() else {}


def _fsync(path: str | Path) -> None:
    """Flush one file or folder (a folder's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def marker_id(checkpoint: Path) -> str:
    """The id a child's marker names as its parent (an old marker's: its folder name)."""
    return lineage.read_marker(checkpoint).get("id") or checkpoint.name


def _branch_id(checkpoint: Path) -> str:
    """The start of its marker's id; a fresh one for an old-style or damaged marker, which has none (its
    folder name would not be a checkpoint name: never listed, rotated or logged again)."""
    found = lineage.read_marker(checkpoint).get("id")
    return found[:8] if found else uuid.uuid4().hex[:8]


def commit(tmp_dir: Path, final_dir: Path, marker: dict, parent: str | None = None) -> dict:
    """Make a fully written tmp folder a checkpoint: hash and fsync every file, write the marker (lineage and
    manifest added to `marker`), rename. Main process only. Returns the marker."""
    nodes = lineage.nodes(complete_checkpoints(final_dir.parent.parent))
    for root, _dirs, files in os.walk(tmp_dir):
        for name in files:  # safetensors' save_file makes its file 0600: the group could not read weights
            os.chmod(Path(root) / name, permissions(0o666))
        _fsync(root)
    marker = dict(
        lineage.new_marker(
            marker["step"],
            marker.get("world_size", 1),
            parent,
            lineage.next_sequence(nodes),
            lineage.build_manifest(tmp_dir),
        ),
        **{key: value for key, value in marker.items() if key not in ("step", "world_size")},
    )
    marker_path = tmp_dir / COMPLETE
    marker_path.write_text(json.dumps(marker, sort_keys=True) + "\n")
    _fsync(marker_path)
    if is_complete(final_dir):  # another branch's checkpoint of this step: kept, under its branch name
        os.replace(final_dir, final_dir.with_name(f"{final_dir.name}.branch-{_branch_id(final_dir)}"))
    replace_folder(tmp_dir, final_dir)  # a folder of this name without a marker is replaced
    _fsync(final_dir.parent)
    return marker


def rotate(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete the current timeline's complete checkpoints beyond its newest `keep_last` (other branches are
    left alone), and leftover partial folders. Called only after a new checkpoint is committed. Returns what
    was deleted."""
    deleted = [node.path for node in current_lineage(run_dir)[keep_last:]]
    for path in deleted:
        shutil.rmtree(path)
    return deleted + remove_partial(run_dir)


def remove_partial(run_dir: str | Path) -> list[Path]:
    """Delete what interrupted writes leave: step_N.tmp (a crash or a full disk mid-save) and .step_N.old.*
    (a crash mid-replace). Only while this run holds the run folder's lock."""
    folder = checkpoints_dir(run_dir)
    removed = []
    for entry in folder.iterdir() if folder.is_dir() else []:
        if entry.is_dir() and (entry.name.endswith(TMP_SUFFIX) or entry.name.startswith(".")):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _mount_point(path: Path) -> str:
    path = Path(os.path.realpath(path))
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return str(path)


def _disk_full(error: BaseException, folder: Path, needed_bytes: int) -> bool:
    """ENOSPC/EDQUOT anywhere in the chain, or a failed write with less space left than a checkpoint needs
    (torch.save reports a full disk as a RuntimeError "file write failed", without an errno)."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return shutil.disk_usage(folder).free < max(needed_bytes, 1 << 20)


def _describe_failure(error: BaseException, folder: Path, needed_bytes: int) -> tuple[str, str]:
    return (
        "disk full" if _disk_full(error, folder, needed_bytes) else "error",
        f"{type(error).__name__}: {error}",
    )


class _TiedWeightsNote(logging.Filter):
    """accelerate warns on every save that it stored the tied embedder once; that is by design here
    (safetensors stores shared storage once, and loading re-ties it)."""

    def filter(self, record):
        return "Removed shared tensor" not in record.getMessage()


logging.getLogger("accelerate.utils.other").addFilter(_TiedWeightsNote())


def save_checkpoint(
    accelerator,
    run_dir: str | Path,
    step: int,
    *,
    ema,
    scheduler,
    train_state: dict,
    plan: dict,
    config: dict,
    keep_last: int,
    sidecar: dict | None = None,
    before_commit=None,
    parent: str | None = CONTINUE,
) -> Path:
    """Write a checkpoint for `step` from ALL ranks; return its final folder once it is complete.

    `sidecar` (`dit_accel.models.diffusers_format.sidecar(model)`) records what the weights alone do not say: the timestep shift.
    `parent` is the marker id of the checkpoint before it on its timeline (None: the first of a new run;
    CONTINUE: the folder's most recently written one).

    A failed write on any rank (a full disk: one line naming it, exit 2) removes the partial folder and
    raises on every rank alike: the ranks agree on the outcome in one collective, so none is left waiting.

    `before_commit(tmp_dir, step)` is a test hook run on the main process after the data is written and before
    the marker: a test kills the process there to prove a half-written checkpoint is never loaded.
    """
    run_dir = Path(run_dir)
    final_dir = checkpoints_dir(run_dir) / checkpoint_name(step)
    tmp_dir = final_dir.with_name(final_dir.name + TMP_SUFFIX)
    previous = latest_checkpoint(run_dir)
    needed_bytes = lineage.size_bytes(previous) if previous is not None else 0
    failure = None
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # a leftover from a crash at this very step
            tmp_dir.mkdir(parents=True)
        accelerator.wait_for_everyone()
        # Model, optimizer, scaler on the main process; RNG states on every rank.
        accelerator.save_state(output_dir=str(tmp_dir))
        if ema is not None and (ema.sharded or accelerator.is_main_process):
            # sharded: every rank joins the gather
            ema.save(tmp_dir / EMA_WEIGHTS, write=accelerator.is_main_process)
        if accelerator.is_main_process:
            write_bytes_atomically(tmp_dir / SCHEDULER_STATE, scheduler_state_json(scheduler).encode())
            write_json_atomically(tmp_dir / TRAIN_STATE, train_state)
            write_json_atomically(tmp_dir / PLAN, plan)
            write_json_atomically(tmp_dir / TRAIN_CONFIG, config)
            if sidecar is not None:
                from dit_accel.models.diffusers_format import SIDECAR_NAME

                write_json_atomically(tmp_dir / SIDECAR_NAME, sidecar)
            if (run_dir / METRICS).is_file():  # the lines of this checkpoint's timeline, for a resume
                shutil.copyfile(run_dir / METRICS, tmp_dir / METRICS)
    except Exception as error:
        failure = error
    # One collective, reached by every rank whatever happened: every rank's random_states_R.pkl is on disk,
    # or every rank learns which one failed.
    outcomes = gathered(
        accelerator,
        None if failure is None else _describe_failure(failure, tmp_dir.parent, needed_bytes),
    )
    if any(outcomes):
        _give_up(accelerator, tmp_dir, final_dir, outcomes, failure, needed_bytes)
    if parent == CONTINUE:
        parent = marker_id(previous) if previous is not None else None

    def commit_and_rotate() -> None:
        expected = [f"random_states_{rank}.pkl" for rank in range(accelerator.num_processes)]
        missing = [name for name in expected if not (tmp_dir / name).exists()]
        if missing:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise UserError(
                f"checkpoint {tmp_dir} lacks {missing}",
                f"put {run_dir} on a filesystem every node shares",
            )
        if before_commit is not None:
            before_commit(tmp_dir, step)
        try:
            commit(tmp_dir, final_dir, {"step": step, "world_size": accelerator.num_processes}, parent)
        except OSError as error:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            if _disk_full(error, tmp_dir.parent, needed_bytes):
                raise _disk_full_error(tmp_dir.parent, final_dir, needed_bytes) from error
            raise
        rotate(run_dir, keep_last)

    main_decides(accelerator, commit_and_rotate)
    return final_dir


def _disk_full_error(folder: Path, final_dir: Path, needed_bytes: int) -> UserError:
    free_bytes = shutil.disk_usage(folder).free
    return UserError(
        f"no space left on {_mount_point(folder)} while saving checkpoint {final_dir.name}: needs about "
        f"{needed_bytes / 2**30:.3g} GiB, {free_bytes / 2**30:.3g} GiB free",
        "free space or point --output-dir at a larger disk",
    )


def _give_up(accelerator, tmp_dir: Path, final_dir: Path, outcomes: list, failure, needed_bytes: int):
    """Every rank, after a failed write on any: the partial folder goes (so a full disk is not kept full),
    then the same error on every rank."""
    if not needed_bytes:  # the run's first checkpoint: at least what was written before the disk filled
        needed_bytes = sum(path.stat().st_size for path in tmp_dir.rglob("*") if path.is_file())
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    accelerator.wait_for_everyone()
    if any(outcome and outcome[0] == "disk full" for outcome in outcomes):
        if failure is not None:
            log.error(f"while saving checkpoint {final_dir.name}: {failure}", extra={"file_only": True})
        raise agreed(_disk_full_error(tmp_dir.parent, final_dir, needed_bytes)) from failure
    if failure is not None:
        raise failure
    rank = next(index for index, outcome in enumerate(outcomes) if outcome)
    raise RuntimeError(f"rank {rank} failed writing checkpoint {tmp_dir}: {outcomes[rank][1]}")


class Checkpointer:
    """`save_checkpoint` with what stays the same for a whole run bound once: the loop passes a step and its
    train state. It follows the run's own timeline: the first checkpoint's parent is the one the run resumed
    from (`parent`, None for a new run), each later one's the one before it."""

    def __init__(
        self,
        accelerator,
        run_dir: Path,
        *,
        ema,
        scheduler,
        plan: dict,
        config: dict,
        keep_last: int,
        sidecar: dict | None = None,
        before_commit=None,
        parent: Path | None = None,
    ):
        self.accelerator, self.run_dir = accelerator, Path(run_dir)
        self.parent = marker_id(Path(parent)) if parent is not None else None
        self.settings = dict(
            ema=ema,
            scheduler=scheduler,
            plan=plan,
            config=config,
            keep_last=keep_last,
            sidecar=sidecar,
            before_commit=before_commit,
        )
        self._abandoned_logged: list[str] = []
        if accelerator.is_main_process:  # the run holds the folder's lock: leftovers are nobody's
            removed = remove_partial(self.run_dir)
            if removed:
                log.info(f"removed partial checkpoint folders left by an interrupted run: {_names(removed)}")

    def save(self, step: int, train_state: dict) -> Path:
        final = save_checkpoint(
            self.accelerator, self.run_dir, step, train_state=train_state, parent=self.parent, **self.settings
        )
        self.parent = marker_id(final)
        if self.accelerator.is_main_process:  # the one that logs reads the markers; the others need not
            abandoned = [path.name for path in abandoned_checkpoints(self.run_dir)]
            if abandoned and abandoned != self._abandoned_logged:
                log.info(
                    f"kept {len(abandoned)} checkpoints of abandoned branches (not on this run's timeline; "
                    f"delete them when no longer needed): {', '.join(abandoned)}"
                )
            self._abandoned_logged = abandoned
        return final


def _names(paths: list[Path]) -> str:
    return ", ".join(path.name for path in paths)


class _AlreadyRead:
    """Stands in for the lr scheduler while Accelerate reads an older checkpoint's custom_checkpoint_0.pkl."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def load_checkpoint(accelerator, checkpoint: str | Path, *, ema, scheduler) -> dict:
    """Restore everything `save_checkpoint` wrote, on every rank; returns the train state. Nothing read runs
    code (run.pickles, run.sharded), and no stored number steers the learning rate: the schedule is a function
    of the applied steps (train_state.json, checked), so lr_scheduler.json is written for people, never read."""
    import pickle

    checkpoint = Path(checkpoint)
    if not is_complete(checkpoint):
        raise UserError(f"checkpoint {checkpoint} is incomplete (no {COMPLETE} marker): use another one")
    state = read_train_state(checkpoint)
    check_before_load(checkpoint, accelerator.process_index)
    check_sharded_saves(checkpoint)
    for name in (MODEL_WEIGHTS, EMA_WEIGHTS):
        if (checkpoint / name).is_file():
            records.check_safetensors(checkpoint / name)
    if (checkpoint / "optimizer.bin").is_file():
        records.check_torch_zip(checkpoint / "optimizer.bin")
    # An older checkpoint holds the scheduler as custom_checkpoint_0.pkl, and Accelerate refuses a folder whose
    # count of such files differs from its registered objects: a stand-in takes the file, read weights-only
    # here first (so Accelerate's own weights_only=False read of it meets nothing but plain data).
    legacy = (checkpoint / LEGACY_SCHEDULER_STATE).is_file() and not (checkpoint / SCHEDULER_STATE).is_file()
    stand_in = _AlreadyRead()
    if legacy:
        load_weights_only(checkpoint / LEGACY_SCHEDULER_STATE)
        accelerator.register_for_checkpointing(stand_in)
    try:
        accelerator.load_state(str(checkpoint))
    except pickle.UnpicklingError as error:  # the one pickle left unread: AdamW's state, read weights-only
        asked = re.search(r"GLOBAL ([\w.]+)", str(error))
        raise refused(
            checkpoint / "optimizer.bin", f"asks for {asked.group(1) if asked else 'a Python object'}"
        ) from None
    finally:
        if legacy:
            accelerator._custom_objects.remove(stand_in)  # later saves write lr_scheduler.json only
    # train.resume sets the lrs from the applied steps; torch counts step() calls, the first at construction
    scheduler.last_epoch = state.get("applied_steps", state["step"])
    scheduler._step_count = scheduler.last_epoch + 1
    if ema is not None:
        ema.load(checkpoint / EMA_WEIGHTS)
    return state
