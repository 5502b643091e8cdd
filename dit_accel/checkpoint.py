"""Checkpoints that count only once complete: commit, rotate and resume around `accelerator.save_state`.

`accelerator.save_state` writes into its folder in place, and with automatic naming it prunes old
checkpoints BEFORE the new one exists, so a crash mid-write can leave no usable checkpoint at all. Here
every rank writes into `checkpoints/step_NNNNNNNN.tmp/`; once all ranks are done the main process fsyncs
every file, writes the `COMPLETE` marker, renames the folder to `step_NNNNNNNN/` and only then deletes the
oldest complete checkpoints beyond `keep_last`. A folder without the marker is never loaded.

Layout of one checkpoint folder (see docs/training.md):

    model.safetensors          the trained weights (accelerate's save_state)
    optimizer.bin              AdamW state (accelerate)
    pytorch_model_fsdp_0/      sharded plans (FSDP2) instead of the two above: weights and AdamW state as
    optimizer_0/               torch.distributed.checkpoint folders, each rank writing its own shards
    custom_checkpoint_0.pkl    the lr scheduler (registered with accelerate; never prepared, see optim.py)
    scaler.pt                  the fp16 grad scaler, only with fp16 (accelerate)
    random_states_R.pkl        python/numpy/torch RNG states of rank R, and accelerate's micro-step counter
    ema.safetensors            fp32 EMA weights, keyed like the unwrapped model's parameters (full tensors
                               even when sharded: gathered at save time, so sampling needs no process group)
    train_state.json           step, applied/skipped steps, data position, world size, global batch
    plan.json                  the plan this run trained with
    train_config.json          the run's TrainConfig
    dit_accel.json             the network's spec and timestep shift (0 for weights from an original DiT)
    COMPLETE                   written last; its presence is what makes the folder a checkpoint
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from dit_accel.atomic import replace_folder, write_json_atomically
from dit_accel.errors import UserError
from planner.planfile import read_plan

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
TMP_SUFFIX = ".tmp"
TRAIN_STATE = "train_state.json"
EMA_WEIGHTS = "ema.safetensors"
MODEL_WEIGHTS = "model.safetensors"
SHARDED_MODEL = "pytorch_model_fsdp_0"  # accelerate's FSDP SHARDED_STATE_DICT folder for model 0
PLAN = "plan.json"
TRAIN_CONFIG = "train_config.json"
_NAME = re.compile(r"^step_(\d{8,})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def is_complete(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and _NAME.match(path.name) is not None and (path / COMPLETE).is_file()


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint of a run, oldest first. Partial folders are skipped."""
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match and is_complete(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


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
    """`--resume auto`: the newest complete checkpoint of this run, or None to start fresh."""
    if resume is None:
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir)
    return resolve_checkpoint(resume)


def read_train_state(checkpoint: str | Path) -> dict:
    return json.loads((Path(checkpoint) / TRAIN_STATE).read_text())


def _fsync_tree(folder: Path) -> None:
    """Flush every file and the folder itself, so COMPLETE never lands before the data on a crash."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


def _fsync(path: str | Path) -> None:
    """Flush one file or folder (a folder's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp_dir: Path, final_dir: Path, marker: dict) -> None:
    """Make a fully written tmp folder a checkpoint: fsync, marker, rename. Main process only."""
    _fsync_tree(tmp_dir)
    marker_path = tmp_dir / COMPLETE
    marker_path.write_text(json.dumps(marker, sort_keys=True) + "\n")
    _fsync(marker_path)
    replace_folder(
        tmp_dir, final_dir
    )  # re-training over a step after resuming from an older checkpoint replaces it
    _fsync(final_dir.parent)


def rotate(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last`, and leftover partial folders.
    Called only after a new checkpoint is committed. Returns what was deleted."""
    folder = checkpoints_dir(run_dir)
    deleted = []
    for _step, path in complete_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(path)
        deleted.append(path)
    for entry in folder.iterdir() if folder.is_dir() else []:
        # a crash mid-write leaves step_N.tmp; one mid-replace, the old step_N moved aside (.step_N.old.*)
        if entry.is_dir() and (entry.name.endswith(TMP_SUFFIX) or entry.name.startswith(".")):
            shutil.rmtree(entry, ignore_errors=True)
            deleted.append(entry)
    return deleted


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
    train_state: dict,
    plan: dict,
    config: dict,
    keep_last: int,
    sidecar: dict | None = None,
    before_commit=None,
) -> Path:
    """Write a checkpoint for `step` from ALL ranks; return its final folder once it is complete.

    `sidecar` (`dit_accel.model.sidecar(model)`) records what the weights alone do not say: the timestep shift.

    `before_commit(tmp_dir, step)` is a test hook run on the main process after the data is written and before
    the marker: a test kills the process there to prove a half-written checkpoint is never loaded.
    """
    final_dir = checkpoints_dir(run_dir) / checkpoint_name(step)
    tmp_dir = final_dir.with_name(final_dir.name + TMP_SUFFIX)
    if accelerator.is_main_process:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # a leftover from a crash at this very step
        tmp_dir.mkdir(parents=True)
    accelerator.wait_for_everyone()
    # Model, optimizer, registered scheduler, scaler on the main process; RNG states on every rank.
    accelerator.save_state(output_dir=str(tmp_dir))
    if ema is not None and (ema.sharded or accelerator.is_main_process):
        ema.save(
            tmp_dir / EMA_WEIGHTS, write=accelerator.is_main_process
        )  # sharded: every rank joins the gather
    if accelerator.is_main_process:
        write_json_atomically(tmp_dir / TRAIN_STATE, train_state)
        write_json_atomically(tmp_dir / PLAN, plan)
        write_json_atomically(tmp_dir / TRAIN_CONFIG, config)
        if sidecar is not None:
            from dit_accel.model import SIDECAR_NAME

            write_json_atomically(tmp_dir / SIDECAR_NAME, sidecar)
    accelerator.wait_for_everyone()  # every rank's random_states_R.pkl is on disk
    if accelerator.is_main_process:
        expected = [f"random_states_{rank}.pkl" for rank in range(accelerator.num_processes)]
        missing = [name for name in expected if not (tmp_dir / name).exists()]
        if missing:
            raise RuntimeError(
                f"checkpoint {tmp_dir} lacks {missing}: is {run_dir} on a filesystem every node shares?"
            )
        if before_commit is not None:
            before_commit(tmp_dir, step)
        commit(tmp_dir, final_dir, {"step": step, "world_size": accelerator.num_processes})
        rotate(run_dir, keep_last)
    accelerator.wait_for_everyone()
    return final_dir


class Checkpointer:
    """`save_checkpoint` with what stays the same for a whole run bound once: the loop passes a step and its
    train state."""

    def __init__(
        self,
        accelerator,
        run_dir: Path,
        *,
        ema,
        plan: dict,
        config: dict,
        keep_last: int,
        sidecar: dict | None = None,
        before_commit=None,
    ):
        self.accelerator, self.run_dir = accelerator, run_dir
        self.settings = dict(
            ema=ema,
            plan=plan,
            config=config,
            keep_last=keep_last,
            sidecar=sidecar,
            before_commit=before_commit,
        )

    def save(self, step: int, train_state: dict) -> Path:
        return save_checkpoint(self.accelerator, self.run_dir, step, train_state=train_state, **self.settings)


def load_checkpoint(accelerator, checkpoint: str | Path, *, ema) -> dict:
    """Restore everything `save_checkpoint` wrote, on every rank; returns the train state."""
    checkpoint = Path(checkpoint)
    if not is_complete(checkpoint):
        raise UserError(f"checkpoint {checkpoint} is incomplete (no {COMPLETE} marker): use another one")
    accelerator.load_state(str(checkpoint))
    if ema is not None:
        ema.load(checkpoint / EMA_WEIGHTS)
    return read_train_state(checkpoint)


def load_for_inference(checkpoint_or_run_dir: str | Path, use_ema: bool = True, device="cpu"):
    """(model, spec, info) for sampling or export: the EMA weights by default, in fp32, in eval mode.

    `checkpoint_or_run_dir` is a checkpoint folder or a run folder (its newest complete checkpoint). The
    timestep shift comes from the checkpoint's `dit_accel.json` when it has one (0 for weights that began as an
    original DiT checkpoint), else it is diffusers' (1). `info` holds the train state plus `checkpoint` (the
    folder) and `weights` ("ema" or "model").
    """
    from safetensors.torch import load_file

    from dit_accel.model import DIFFUSERS_FREQ_SHIFT, build_model, read_sidecar

    checkpoint = resolve_checkpoint(checkpoint_or_run_dir)
    spec = read_plan(checkpoint / PLAN).spec()
    model = build_model(
        spec, timestep_freq_shift=read_sidecar(checkpoint).get("timestep_freq_shift", DIFFUSERS_FREQ_SHIFT)
    )
    if use_ema and (checkpoint / EMA_WEIGHTS).exists():
        state, weights = load_file(str(checkpoint / EMA_WEIGHTS)), "ema"
    elif use_ema:
        raise UserError(
            f"{checkpoint} has no EMA weights ({EMA_WEIGHTS}): pass use_ema=False for the raw weights"
        )
    elif (checkpoint / SHARDED_MODEL).is_dir():
        state, weights = read_sharded_model(checkpoint / SHARDED_MODEL, model), "model"
    else:
        state, weights = load_file(str(checkpoint / MODEL_WEIGHTS)), "model"
    state = {name.removeprefix("module."): tensor for name, tensor in state.items()}
    _load_into(model, state, strict_params_only=(weights == "ema"))
    model.to(device).eval()
    info = dict(read_train_state(checkpoint), checkpoint=str(checkpoint), weights=weights)
    return model, spec, info


def load_weights(path: str | Path, use_ema: bool = True, device="cpu"):
    """(model, spec, info) from any folder of DiT weights dit-accel reads: a checkpoint or run folder
    (`load_for_inference`: EMA or raw weights), or a diffusers transformer or DiTPipeline folder (its one set of
    weights; `info["weights"]` is "diffusers"). Sampling, export and fine-tuning (`--init-from`) all start here."""
    path = Path(path)
    if not path.exists():
        raise UserError(
            f"{path} does not exist: pass a run folder, a checkpoint folder or a diffusers DiT folder"
        )
    if (path / "config.json").is_file() or (path / "transformer" / "config.json").is_file():
        from dit_accel.model import load_model, spec_from_model

        model = load_model(path).to(device).eval()
        return model, spec_from_model(model), {"checkpoint": str(path.absolute()), "weights": "diffusers"}
    return load_for_inference(path, use_ema=use_ema, device=device)


def read_sharded_model(folder: Path, model) -> dict:
    """The full weights of a sharded (FSDP2, torch.distributed.checkpoint) save, read in this one process
    into `model`'s layout: no process group needed."""
    import torch.distributed.checkpoint as dcp

    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    dcp.load({"model": state}, checkpoint_id=str(folder), no_dist=True)
    return state


def _load_into(model, state: dict, strict_params_only: bool) -> None:
    """Load weights; the EMA holds parameters only (buffers such as the positional table are rebuilt)."""
    import torch

    params = dict(model.named_parameters())
    if strict_params_only:
        missing = sorted(set(n for n, p in params.items() if p.requires_grad) - set(state))
        unexpected = sorted(set(state) - set(params))
        if missing or unexpected:
            raise UserError(
                f"EMA weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)
    else:
        result = model.load_state_dict(state, strict=False)
        # Tied weights are stored once; any other missing key is a real mismatch.
        shared_ok = [k for k in result.missing_keys if not _is_tied_copy(model, k, state)]
        if shared_ok or result.unexpected_keys:
            raise UserError(
                f"model weights do not fit the model: missing {shared_ok[:3]}, "
                f"unexpected {result.unexpected_keys[:3]}"
            )


def _is_tied_copy(model, key: str, state: dict) -> bool:
    """A key dropped at save because it shares storage with a saved one (the tied embedder)."""
    tensors = dict(model.state_dict(keep_vars=True))
    target = tensors.get(key)
    if target is None:
        return False
    return any(
        tensors.get(other) is not None and tensors[other].data_ptr() == target.data_ptr() for other in state
    )
