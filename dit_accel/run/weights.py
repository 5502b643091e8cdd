"""A run's weights read for sampling, export and fine-tuning (`--init-from`): the EMA or raw weights of a
checkpoint or a run folder (the files read checked against its manifest first), a diffusers folder, a sharded
save read in one process; and what a checkpoint records beside its weights: the objective it was trained with,
and how much of its EMA is still the weights it started from."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dit_accel.errors import UserError
from dit_accel.run import lineage
from dit_accel.run.checkpoint import (
    _NAME,
    EMA_WEIGHTS,
    MODEL_WEIGHTS,
    PLAN,
    SHARDED_MODEL,
    TRAIN_CONFIG,
    TRAIN_STATE,
    current_lineage,
    read_train_state,
    resolve_checkpoint,
)
from planner.planfile import read_plan


def intact_for_inference(checkpoint_or_run_dir: str | Path, use_ema: bool = True) -> Path:
    """The checkpoint `load_for_inference` reads, the files it reads checked against the manifest (as
    `--resume auto` checks a whole checkpoint): a damaged checkpoint folder is refused in one line; a run folder
    gives its newest intact checkpoint, with a warning naming a damaged newer one."""
    from dit_accel.models.diffusers_format import SIDECAR_NAME

    path = Path(checkpoint_or_run_dir)
    checkpoint = resolve_checkpoint(path)  # refuses what does not exist or holds no complete checkpoint

    def problem_of(folder: Path) -> str | None:
        weights = SHARDED_MODEL if (folder / SHARDED_MODEL).is_dir() else MODEL_WEIGHTS
        names = [PLAN, TRAIN_STATE, TRAIN_CONFIG, SIDECAR_NAME, EMA_WEIGHTS if use_ema else weights]
        return lineage.damage(folder, names)

    problem = problem_of(checkpoint)
    if problem is None:
        return checkpoint
    if checkpoint == path or _NAME.match(path.name):
        raise UserError(
            f"checkpoint {checkpoint} is damaged: {problem}",
            "pass an older checkpoint (a run folder gives its newest intact one) or restore the file",
        )
    for node in current_lineage(checkpoint.parent.parent)[1:]:
        if problem_of(node.path) is None:
            if int(os.environ.get("RANK", "0") or 0) == 0:  # each rank checks what it reads; one says so
                print(
                    f"warning: skipping damaged checkpoint {checkpoint.name} ({problem}); reading "
                    f"{node.path.name}, the newest intact one of {path}",
                    file=sys.stderr,
                )
            return node.path
    raise UserError(
        f"every checkpoint of the current timeline in {checkpoint.parent} is damaged (newest: {problem})",
        "restore the files, or pass another checkpoint",
    )


def load_for_inference(checkpoint_or_run_dir: str | Path, use_ema: bool = True, device="cpu"):
    """(model, spec, info) for sampling or export: the EMA weights by default, in fp32, in eval mode.

    `checkpoint_or_run_dir` is a checkpoint folder or a run folder (its newest intact checkpoint: the files
    read are checked against the manifest first, `intact_for_inference`). The
    timestep shift comes from the checkpoint's `dit_accel.json` when it has one (0 for weights that began as an
    original DiT checkpoint), else it is diffusers' (1). `info` holds the train state plus `checkpoint` (the
    folder) and `weights` ("ema" or "model").
    """
    from safetensors.torch import load_file

    from dit_accel.models.diffusers_format import read_sidecar
    from dit_accel.models.dit import DIFFUSERS_FREQ_SHIFT, build_model
    from dit_accel.repa.align import without_projector  # trained with a REPA model, never sampled
    from dit_accel.run.records import check_safetensors

    checkpoint = intact_for_inference(checkpoint_or_run_dir, use_ema)
    spec = read_plan(checkpoint / PLAN).spec()
    model = build_model(
        spec, timestep_freq_shift=read_sidecar(checkpoint).get("timestep_freq_shift", DIFFUSERS_FREQ_SHIFT)
    )
    if use_ema and (checkpoint / EMA_WEIGHTS).exists():
        check_safetensors(checkpoint / EMA_WEIGHTS)
        state, weights = load_file(str(checkpoint / EMA_WEIGHTS)), "ema"
    elif use_ema:
        raise UserError(
            f"{checkpoint} has no EMA weights ({EMA_WEIGHTS}): pass use_ema=False for the raw weights"
        )
    elif (checkpoint / SHARDED_MODEL).is_dir():
        state, weights = read_sharded_model(checkpoint / SHARDED_MODEL, model), "model"
    else:
        check_safetensors(checkpoint / MODEL_WEIGHTS)
        state, weights = load_file(str(checkpoint / MODEL_WEIGHTS)), "model"
    state = {name.removeprefix("module."): tensor for name, tensor in without_projector(state).items()}
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
        from dit_accel.models.diffusers_format import load_model
        from dit_accel.models.dit import spec_from_model

        model = load_model(path).to(device).eval()
        return model, spec_from_model(model), {"checkpoint": str(path.absolute()), "weights": "diffusers"}
    return load_for_inference(path, use_ema=use_ema, device=device)


def read_sharded_model(folder: Path, model) -> dict:
    """The full weights of a sharded (FSDP2, torch.distributed.checkpoint) save, read in this one process
    into `model`'s layout: no process group needed."""
    import torch.distributed.checkpoint as dcp

    from dit_accel.run.sharded import check_sharded_save

    check_sharded_save(folder, tensors_only=True)  # torch would unpickle its index and any bytes entry
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


def recorded_objective(folder) -> dict:
    """The objective recorded beside a model's weights (the `dit_accel.json` of a checkpoint, a run's newest
    checkpoint, or a diffusers transformer/pipeline folder); {"name": "ddpm"} where none is (DiT's)."""
    from pathlib import Path

    from dit_accel.models.diffusers_format import SIDECAR_NAME, read_sidecar

    folder = Path(folder)
    if (folder / "checkpoints").is_dir():  # a run folder: its newest complete checkpoint
        from dit_accel.run.checkpoint import resolve_checkpoint

        folder = resolve_checkpoint(folder)
    for candidate in (folder, folder / "transformer"):
        if (candidate / SIDECAR_NAME).is_file():
            return read_sidecar(candidate).get("objective") or {"name": "ddpm"}
    return {"name": "ddpm"}


def initial_weight_share(decay: float, warmup: bool, updates: int) -> float:
    """How much of the EMA is still the weights it started from after `updates` updates: decay^n for the
    constant decay (0.9999^325 = 0.968: a short run's EMA is nearly its initialisation), 0 with warm-up
    (its first update copies the weights)."""
    if warmup and updates > 0:
        return 0.0
    return decay**updates
